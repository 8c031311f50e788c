"""What the command lines share: configs by path or by name, and one line for every mistake.

    --config=configs/pi_attention.py        a config file (`:preset` after it: configs/bcmt.py:128)
    --config=pi_attention  --config=bcmt:128  a config shipped with the package, by name

The configs are loaded by `config_files` (its names are here too). `parse_flags` is absl's
`flags_parser` for `app.run`: a mistake on the command line (an unknown flag or config field, with
the closest names; a value of the wrong type; a missing config file; an unknown preset, with the
presets the file has) prints one `error: ...` line and exits with status 2, before anything is
imported or compiled. `--help` (the command's flags, the models and every config field) and
`--help=<model>` (the fields it reads) print `help`'s listing and exit 0.
"""

import difflib
import sys
from typing import NoReturn

import ml_collections
from absl import flags

from efficient_lm.cli import help as help_lib
from efficient_lm.config import files as config_files
from efficient_lm.config.errors import ConfigError
from efficient_lm.runtime import exit_codes

EXIT_USAGE = exit_codes.USAGE


# (Here too, as the library and the tests have called them: cli.load_config, ...)
config_names = config_files.config_names
resolve = config_files.resolve
load_config = config_files.load_config


def _fields(config, prefix: str = "") -> list[str]:
  out = []
  for key, value in config.items():
    out.append(prefix + key)
    if isinstance(value, ml_collections.ConfigDict):
      out += _fields(value, prefix + key + ".")
  return out


def _unknown_override(config: ml_collections.ConfigDict, argv: list[str]) -> str | None:
  """The one-line error for the first `--config.<field>` the config does not have, or None."""
  fields = _fields(config)
  for arg in argv:
    if not arg.startswith("--config."):
      continue
    field = arg[len("--config."):].split("=", 1)[0]
    if field in fields:
      continue
    close = difflib.get_close_matches(field, fields, n=3, cutoff=0.6)
    section = field.rsplit(".", 1)[0] if "." in field else ""
    hint = (f"did you mean {' or '.join(close)}?" if close else
            f"the fields of {section or 'the config'} are "
            f"{', '.join(f for f in fields if f.rsplit('.', 1)[0] == section)[:400]}")
    return f"--config.{field} is not a config field; {hint}"
  return None


def parse_flags(argv: list[str]) -> list[str]:
  """absl's flag parsing (for `app.run(main, flags_parser=parse_flags)`), with every mistake one
  line on stderr and exit status 2. `--help` and `--help=<model>` print their listing (`help`)
  and exit 0."""
  help_lib.answer(argv)
  unknown = _unknown_flag(argv[1:])
  if unknown:  # before the config file is loaded (it imports the models, and jax)
    fail(f"Unknown command line flag '{unknown}'")
  given = [arg[len("--config="):] for arg in argv if arg.startswith("--config=")]
  argv = [_resolved(arg) for arg in argv]
  base = None
  try:
    if given:  # the file and preset loaded plainly first: its own errors, then unknown fields
      base = load_config(given[-1], shown=given[-1])
      problem = _unknown_override(base, argv)
      if problem:
        raise ConfigError(problem)
    rest = flags.FLAGS(argv)
    if base is not None:
      flags.FLAGS.config  # pylint: disable=pointless-statement  (applies the overrides)
  except flags.Error as e:
    fail(_flag_error(str(e), base))
  except ConfigError as e:
    fail(str(e))
  except (OSError, ValueError, TypeError, KeyError, AttributeError) as e:
    fail(" ".join(str(e).split())[:500] or type(e).__name__)
  return rest


def _unknown_flag(args: list[str]) -> str | None:
  """The first `--name` that is no flag of this command (nor `--noname` of a boolean one, nor a
  `--config.<field>`, which the config answers), or None; what follows `--` is not flags."""
  known = flags.FLAGS
  for arg in args:
    if arg == "--":
      return None
    if not arg.startswith("-") or arg in ("-", "--") or _is_number(arg):  # (a value: -1)
      continue
    name = arg.lstrip("-").split("=", 1)[0]
    if name.startswith("config.") or name in known or name in ("flagfile", "undefok"):
      continue
    if name.startswith("no") and name[2:] in known and isinstance(known[name[2:]], flags.BooleanFlag):
      continue
    return name
  return None


def _is_number(text: str) -> bool:
  try:
    float(text)
  except ValueError:
    return False
  return True


def _flag_error(message: str, base) -> str:
  """absl's message for a bad flag value, as one line; a config field's names its type."""
  first = message.splitlines()[0].replace("flag --", "--")
  if base is None or not first.startswith("--config."):
    return first
  field, _, rest = first[len("--config."):].partition("=")
  value, _, detail = rest.partition(": ")
  current = base
  for part in field.split("."):
    current = current[part] if isinstance(current, ml_collections.ConfigDict) and part in current else None
  if current is None or isinstance(current, ml_collections.ConfigDict):
    return first
  kind = {int: "an integer", float: "a number", bool: "True or False", str: "a string"}.get(
      type(current), f"a {type(current).__name__}")
  return (f"--config.{field}={value} is not {kind} ({detail}); give {kind}, e.g. "
          f"--config.{field}={current!r}")


def _resolved(arg: str) -> str:
  """`--config=<name>` as the path of the shipped config (files are left as given)."""
  if arg.startswith("--config="):
    try:
      return "--config=" + resolve(arg[len("--config="):])
    except ConfigError as e:
      fail(str(e))
  return arg


def error(message: object, status: int = exit_codes.USAGE) -> int:
  """`message` (a string or an exception) as the one `error: ...` line on stderr; returns
  `status` (default 2, a mistake of the user's: `exit_codes`) for the command to exit with."""
  print(f"error: {message}", file=sys.stderr)
  return status


def fail(message: object, status: int = exit_codes.USAGE) -> NoReturn:
  """`error(message)`, then exit with `status` at once."""
  sys.exit(error(message, status))


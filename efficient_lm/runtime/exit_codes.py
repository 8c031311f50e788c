"""The exit statuses of the command lines, one meaning each (docs/operations.md, "Exit statuses").

Importing this module imports nothing else: the command lines use it before anything heavy.
"""

SUCCESS = 0
CRASH = 1          # an unexpected error (Python's status for an uncaught exception: a traceback)
USAGE = 2          # a command-line, config, workdir or data mistake: one `error:` line
DOES_NOT_FIT = 3   # the train step needs more memory than a device has (`--compile_only` says so too)
PROCESS_LOST = 4   # a multi-process job lost another process: this one stopped; resumable
PREEMPTED = 75     # SIGTERM to a training run: checkpoint committed (or nothing begun); rerun to
                   # resume (sysexits' EX_TEMPFAIL, "try again later")
INTERRUPTED = 130  # SIGINT (Ctrl-C): 128 + 2, as a shell reports it
TERMINATED = 143   # SIGTERM to a command that is not a training run: 128 + 15

RESUMABLE = (PREEMPTED, PROCESS_LOST)  # what a scheduler should requeue

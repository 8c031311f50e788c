"""The data layer's own error, in a module that imports nothing, so that every data module (the
generated tasks included) can raise it without importing the config checks that open tokenizers."""


class DataError(ValueError):
  """The data itself (not a config field) cannot be used: an empty split, say."""

"""What the kernels' libraries need from the process that runs them."""
from __future__ import annotations

import importlib.util


def mark_absl_flags_parsed() -> None:
    """Outside kernels are often built on libraries that read absl flags (tokamax, MaxText,
    paxml). Unparsed, they raise or parse this process's own argv (`--suite ...`) and fail on
    options that are not theirs. The harness owns the command line: the libraries get their
    flags' defaults."""
    if importlib.util.find_spec("absl") is None:
        return
    from absl import flags
    if not flags.FLAGS.is_parsed():
        flags.FLAGS.mark_as_parsed()

"""A user's mistake (a path, a name, a glob, a module, a baseline, a shape too big for the
device): one line that names the problem and the fix, caught before any work starts. The CLI
prints it and exits 2; the pytest plugin turns it into a usage error. Never a traceback."""


class UsageError(Exception):
    pass


class BrokenContract(ValueError):
    """A kernel's result that breaks the harness's contract (its output's shape), found by the
    harness's own check: the kernel's error, and never a refusal of a feature, whatever the
    message names (it names the value's head dim)."""

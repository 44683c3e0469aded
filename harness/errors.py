"""A user's mistake (a path, a name, a glob, a module, a baseline, a shape too big for the
device): one line that names the problem and the fix, caught before any work starts. The CLI
prints it and exits 2; the pytest plugin turns it into a usage error. Never a traceback."""


class UsageError(Exception):
    pass

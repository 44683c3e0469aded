"""A user's mistake (a path, a name, a glob, a module, a baseline, a shape too big for the
device): one line that names the problem and the fix, caught before any work starts. The CLI
prints it and exits 2; the pytest plugin turns it into a usage error. Never a traceback."""


class UsageError(Exception):
    pass


class BrokenContract(ValueError):
    """A kernel's result that breaks the harness's contract (its output's shape), found by the
    harness's own check: the kernel's error, and never a refusal of a feature, whatever the
    message names (it names the value's head dim)."""


def _pytest_outcomes() -> tuple:
    """pytest.skip, pytest.xfail, pytest.fail and pytest.importorskip raise these, which derive
    from BaseException; a kernel (or its module) calling one stopped, and said nothing the
    harness may take for a skip."""
    try:
        from _pytest.outcomes import OutcomeException
    except ImportError:   # no pytest: no kernel can raise them
        return ()
    return (OutcomeException,)


# What a kernel's code (or its module's, while imported) may raise: any error, a sys.exit() of
# its library (it ended the whole run, or its worker without a word, with status 0), and
# pytest's outcomes. An error, never a skip; KeyboardInterrupt still stops the run.
USER_CODE_RAISED = (Exception, SystemExit, *_pytest_outcomes())

"""python -m harness census: every packed-attention path a JAX user can pick, judged, timed and
written up in one table (issue 18, "the census report").

One command on a GPU runner writes, under --report-dir (default reports/census-latest):

    parts/<part>/nightly/    the suite's records over the census kernels, written by the same
                             code as `harness run` (its controller and isolation workers where
                             the kernels' libraries cannot share a process)
    parts/<part>/bench.json  one `harness bench` run (--shapes census: the seed shape 8 x 2048
                             and 1 x 8192) over the same kernels: fwd+bwd medians, useful
                             TFLOP/s, and each program's footprint from XLA's memory analysis
                             (temp + arguments + outputs)
    parts/<part>/part.json   what ran: kernels, the versions of their libraries, the command
    repro/<kernel>.py        for a kernel with a failing check: `harness repro`'s minimal script
                             per feature set it fails on (that set's first failing case,
                             shrunk): <kernel>.py for the cases without features,
                             <kernel>-<features>.py for the others (<kernel>-window.py,
                             <kernel>-window-sinks.py); for a kernel that raised (an
                             error, or a declared upstream one): a small script calling it on the
                             smallest case it raised on (<kernel>-error.py where it also fails a
                             check); beside each, <kernel>.md (an upstream report text) and
                             <kernel>.txt (the script's output here)
    census.md, census.json   the table, built from every part under parts/ (harness.tools.census.
                             table): a census split over machines (libraries that cannot travel
                             together) is joined by copying the parts into one folder and running
                             `python -m harness census --table-only`

Kernels of several isolation groups (harness.engine.workers): the run is a controller, and
the bench, the versions and the reproducers of each group run in a child process of their own
(harness.tools.census.child), so no two clashing libraries ever share a process.

The package: `options` (the census set and the command line), `command` (main), `child` (a group's
child process), `findings` (reproducers and report texts), `table` (reading the parts, the rows) and `render` (census.md).
"""


def main(census, run) -> int:
    from harness.tools.census.command import main as census_main
    return census_main(census, run)


__all__ = ["main"]

"""python -m harness repro KERNEL CASE_ID: the smallest case that still fails, as a script.

1. Runs the kernel on the case (any case id, not only a suite's) and picks the check to keep
   failing: `--check`, else the first failing tolerance check in the order out, dq, dk, dv, else
   the leak probe. A kernel that passes everything is a usage error.
2. Shrinks the case greedily, as a `custom/rows` case: one row, then fewer rows; fewer segments
   (half of them, a quarter, ..., one), less padding, shorter segments (to one token, halved, one
   less); then the smallest shape at once (one head, the smallest head_dim, no trailing padding:
   each new shape compiles anew, which costs seconds), else step by step: a shorter row (trailing
   padding trimmed, to a length the kernel takes), fewer heads (MHA with one head first, GQA kept
   only where needed), a smaller head_dim (among the kernel's). A candidate is kept when the same
   check still fails (verdict fail) on some segment, against a tensor that is not zero everywhere;
   candidates the kernel does not declare are never run. dtype, causal flag and seed stay. At
   most MAX_RUNS kernel runs.
3. Writes a standalone script: the kernel (its `standalone` source, or an import of its
   function), the shrunk segment ids as a literal, the inputs redrawn with numpy from the case's
   seed (the harness's own draw, so the tolerances below apply), a float32 dense reference, and
   the failing check per segment against the tolerance the harness computed on the shrunk case.
   It exits 1 while the failure shows, 0 once the kernel is fixed.
4. Runs the script with plain python in an empty folder (no PYTHONPATH into this repository) and
   says whether it reproduced the failure.
"""
from __future__ import annotations

import ast
import functools
import os
import platform as _platform
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterator

import numpy as np

from harness.model.case import Case
from harness.errors import UsageError
from harness.judge.judging import CHECKS, FLOAT32_FLOOR_FACTOR, LEAK, TENSORS
from harness.engine.kernel import Kernel, Platform
from harness.model.layouts import CUSTOM, rows_of, segment_ids_from_rows

MAX_RUNS = 150
REPO_ROOT = Path(__file__).resolve().parent.parent
# The script's last line when the failure shows; `verify` looks for it besides exit status 1
# (which an uncaught exception also gives).
FAILED_MARK = "FAILED:"
VERIFY_TIMEOUT_S = 600
# judging.tolerance adds 1e-30 to keep a tolerance positive; a tolerance this small means the
# true tensor is zero everywhere in the case.
DEGENERATE_TOLERANCE = 2e-30


# ----- finding the failure -----------------------------------------------------------------------

@dataclass
class Run:
    case: Case
    records: list[dict]

    def failing(self, check: str, evidence: bool = False) -> list[dict]:
        """The check's failing segment records, worst first (those that are evidence first).
        `evidence`: only those, leaving out failures against a tensor that is zero everywhere in
        the case (its tolerance is then only the 1e-30 that keeps it positive: any rounding
        fails it; e.g. dq of a case made of single-token segments)."""
        bad = [r for r in self.records if r["check"] == check and r["verdict"] == "fail"
               and r.get("segment")]
        if evidence:
            bad = [r for r in bad if _evidence(r)]
        return sorted(bad, key=lambda r: (not _evidence(r), -(
            r["ratio"] if r.get("ratio") is not None else float("inf"))))


def _evidence(record: dict) -> bool:
    return record["check"] == LEAK.name or record["tolerance"] > DEGENERATE_TOLERANCE


class Budget(Exception):
    pass


class Runner:
    """Runs one kernel on cases for one check, each case once, at most `max_runs` times."""

    def __init__(self, kernel: Kernel, platform: Platform, programs, max_runs: int = MAX_RUNS):
        self.kernel, self.platform, self.programs = kernel, platform, programs
        self.max_runs, self.runs = max_runs, 0
        self.check: str | None = None  # the check to keep failing (target_check decides)
        self._seen: dict[tuple, Run | None] = {}

    def supported(self, case: Case) -> bool:
        return not self.kernel.unsupported_reasons(case, self.platform)

    def run(self, case: Case, leak: bool) -> Run:
        from harness.engine.runner import run_kernel_case
        if self.runs >= self.max_runs:
            raise Budget
        self.runs += 1
        return Run(case, run_kernel_case(self.kernel, case, self.platform, self.programs,
                                         leak=leak).records)

    def fails(self, case: Case, check: str) -> Run | None:
        """The run, if `check` fails on some segment of the case."""
        key = (case, check)
        if key not in self._seen:
            if not self.supported(case):
                return None
            run = self.run(case, leak=check == LEAK.name)
            self._seen[key] = run if run.failing(check, evidence=True) else None
        return self._seen[key]


def target_check(runner: Runner, case: Case, check: str | None) -> Run:
    """Runs the original case; returns its run, with `check` resolved (runner.check)."""
    kernel = runner.kernel
    reasons = kernel.unsupported_reasons(case, runner.platform)
    if reasons:
        raise UsageError(f"{kernel.name} does not run {case.id} on {runner.platform.name}: "
                         f"{'; '.join(reasons)}")
    wanted = [check] if check else [c.name for c in TENSORS]
    run = runner.run(case, leak=check == LEAK.name)
    _refuse_errors(kernel, run)
    for name in wanted:
        if run.failing(name):
            runner.check = name
            return run
    if not check:
        run = runner.run(case, leak=True)
        _refuse_errors(kernel, run)
        if run.failing(LEAK.name):
            runner.check = LEAK.name
            return run
        raise UsageError(f"{kernel.name} passes every check on {case.id}: nothing to reproduce")
    raise UsageError(f"{kernel.name} passes the {check} check on {case.id}: nothing to "
                     "reproduce (leave --check out to take the first failing one)")


def _refuse_errors(kernel: Kernel, run: Run) -> None:
    for r in run.records:
        if r["verdict"] == "error":
            first = (r.get("message") or "").splitlines()[0][:300] if r.get("message") else ""
            raise UsageError(f"{kernel.name} raises on {run.case.id} ({first}); repro shrinks "
                             "wrong results, not errors")


# ----- shrinking ---------------------------------------------------------------------------------

def as_custom(case: Case, rows=None, seq_len: int | None = None, heads: int | None = None,
              kv_heads: int | None = None, head_dim: int | None = None) -> Case | None:
    """The case as a custom/rows case with some dimensions replaced; None if invalid. Rows are
    normalized (adjacent padding merged, trailing padding implicit) so equal cases share ids."""
    rows = rows_of(case.segment_ids) if rows is None else tuple(tuple(r) for r in rows)
    seq_len = case.seq_len if seq_len is None else seq_len
    if not rows or any(not any(n > 0 for n in row) for row in rows):
        return None  # a row without a segment says nothing
    try:
        rows = rows_of(segment_ids_from_rows(rows, seq_len))
        return Case(CUSTOM, batch=len(rows), seq_len=seq_len,
                    heads=case.heads if heads is None else heads,
                    kv_heads=case.kv_heads if kv_heads is None else kv_heads,
                    head_dim=case.head_dim if head_dim is None else head_dim,
                    dtype=case.dtype, seed=case.seed, causal=case.causal, rows=rows)
    except ValueError:
        return None


def _row_moves(case: Case, run: Run, check: str) -> Iterator[Case | None]:
    rows = rows_of(case.segment_ids)
    if len(rows) == 1:
        return
    failing_rows = list(dict.fromkeys(r["row"] for r in run.failing(check)))
    for r in failing_rows:                                    # one row: the worst first
        yield as_custom(case, rows=[rows[r]])
    for r in range(len(rows)):                                # one row less
        yield as_custom(case, rows=rows[:r] + rows[r + 1:])


def _replace_run(rows, r, i, new):
    """rows with run i of row r replaced by `new` (removed if None)."""
    row = list(rows[r])
    row[i:i + 1] = [] if new is None else [new]
    return rows[:r] + (tuple(row),) + rows[r + 1:]


def _segment_moves(case: Case, run: Run, check: str) -> Iterator[Case | None]:
    rows = rows_of(case.segment_ids)
    for r, row in enumerate(rows):                            # fewer segments
        segments = [i for i, n in enumerate(row) if n > 0]
        size = len(segments) // 2
        while size >= 1:                                      # half of them, a quarter, ... one
            for first in range(0, len(segments), size):
                drop = set(segments[first:first + size])
                yield as_custom(case, rows=rows[:r] + (tuple(
                    n for i, n in enumerate(row) if i not in drop),) + rows[r + 1:])
            size //= 2
    for r, row in enumerate(rows):                            # less padding inside the row
        for i, n in enumerate(row):
            if n < 0:
                for new in dict.fromkeys([None, -(-n // 2), n + 1]):
                    if new != 0 and new != n:
                        yield as_custom(case, rows=_replace_run(rows, r, i, new))
    for r, row in enumerate(rows):                            # shorter segments
        for i, n in enumerate(row):
            if n > 1:
                for new in dict.fromkeys([1, n // 2, n - 1]):
                    yield as_custom(case, rows=_replace_run(rows, r, i, new))


def _shortest(case: Case, runner: Runner, min_len: int = 0, **dims) -> int:
    """The shortest row, at least as long as the longest row's runs (and min_len), that the
    kernel takes with `dims`; the case's own length if none is shorter."""
    used = max(sum(abs(n) for n in row) for row in rows_of(case.segment_ids))
    for s in range(max(used, min_len), case.seq_len):
        c = as_custom(case, seq_len=s, **dims)
        if c is not None and runner.supported(c):
            return s
    return case.seq_len


def _smallest_shape_moves(case: Case, runner: Runner) -> Iterator[Case | None]:
    """Every shape reduction at once (each new shape compiles anew, which costs seconds):
    the shortest row, one head, and the smallest head_dim; then with head_dim 8 (what fused
    kernels that do not declare their head dims usually take)."""
    kernel = runner.kernel
    smallest = min(kernel.head_dims) if kernel.head_dims is not None else 1
    used = max(sum(abs(n) for n in row) for row in rows_of(case.segment_ids))
    for d in dict.fromkeys([smallest] + ([8] if kernel.head_dims is None else [])):
        dims = dict(heads=1, kv_heads=1, head_dim=min(d, case.head_dim))
        # No trailing padding, then one token of it (bidirectional kernels that read padding).
        for min_len in (0, used + 1):
            yield as_custom(case, seq_len=_shortest(case, runner, min_len, **dims), **dims)


def _seq_len_moves(case: Case, runner: Runner) -> Iterator[Case | None]:
    """Trailing padding trimmed: all of it, all but a token (a bug that needs padding to
    read), then to round lengths (block sizes the kernel needs and does not declare)."""
    used = max(sum(abs(n) for n in row) for row in rows_of(case.segment_ids))
    candidates = [_shortest(case, runner)]
    if used + 1 < case.seq_len:
        candidates.append(_shortest(case, runner, min_len=used + 1))
    # Kernels with block sizes of their own that they do not declare: round numbers too.
    for multiple in (8, 16, 64, 128):
        candidates.append(-(-used // multiple) * multiple)
    for s in sorted(dict.fromkeys(candidates)):
        if s < case.seq_len:
            yield as_custom(case, seq_len=s)


def _head_moves(case: Case) -> Iterator[Case | None]:
    h, kv = case.heads, case.kv_heads
    options = [(1, 1), (2, 1), (kv, kv), (h // 2, max(1, kv // 2)), (h // 2, kv), (h, kv // 2)]
    for heads, kv_heads in dict.fromkeys(options):
        if (1 <= kv_heads <= heads and heads % kv_heads == 0 and heads <= h and kv_heads <= kv
                and (heads, kv_heads) != (h, kv)):
            yield as_custom(case, heads=heads, kv_heads=kv_heads)


def _head_dim_moves(case: Case, kernel: Kernel) -> Iterator[Case | None]:
    d = case.head_dim
    if kernel.head_dims is not None:
        smaller = sorted(x for x in kernel.head_dims if x < d)
        # The smallest the kernel takes, then about half (the largest at most d / 2).
        options = smaller[:1] + [x for x in reversed(smaller) if x <= d // 2][:1]
    else:
        options = [1, d // 2]
    for x in dict.fromkeys(options):
        if 1 <= x < d:
            yield as_custom(case, head_dim=x)


def shrink(runner: Runner, run: Run, check: str, log: Callable[[str], None]) -> Run:
    """Greedy: the first candidate of the first move that still fails is kept, and the moves
    start over from it, until none is kept or the run budget is spent."""
    moves = [
        ("rows", lambda c, r: _row_moves(c, r, check)),
        ("segments", lambda c, r: _segment_moves(c, r, check)),
        ("shape", lambda c, r: _smallest_shape_moves(c, runner)),
        ("seq_len", lambda c, r: _seq_len_moves(c, runner)),
        ("heads", lambda c, r: _head_moves(c)),
        ("head_dim", lambda c, r: _head_dim_moves(c, runner.kernel)),
    ]
    current = run
    try:
        progress = True
        while progress:
            progress = False
            for name, move in moves:
                for candidate in move(current.case, current):
                    if candidate is None or candidate == current.case:
                        continue
                    found = runner.fails(candidate, check)
                    if found is not None:
                        log(f"  {name:9s} {candidate.id}")
                        current, progress = found, True
                        break
                if progress:
                    break
    except Budget:
        log(f"  stopped after {runner.runs} kernel runs (the budget)")
    return current


# ----- the script ----------------------------------------------------------------------------------

def _literal(value) -> str:
    text = repr(value)
    try:
        if ast.literal_eval(text) == value:
            return text
    except (ValueError, SyntaxError):
        pass
    raise UsageError(f"cannot write {value!r} into a script as a literal")


def kernel_source(kernel: Kernel) -> tuple[str, bool]:
    """(Python source defining `kernel(...)`, whether it needs the harness on the path)."""
    if kernel.standalone is not None:
        return kernel.standalone.rstrip() + "\n", False
    fn, args, keywords = kernel.fn, (), {}
    if isinstance(fn, functools.partial):
        fn, args, keywords = fn.func, fn.args, fn.keywords
    module_name = getattr(fn, "__module__", None)
    qualname = getattr(fn, "__qualname__", None)
    module = sys.modules.get(module_name or "")
    resolved = module
    for part in (qualname or "<none>").split("."):
        resolved = getattr(resolved, part, None)
    if module is None or module_name == "__main__" or "<" in (qualname or "<") \
            or resolved is not fn:
        raise UsageError(f"{kernel.name}: its function {fn!r} cannot be imported by name (a "
                         "lambda, a local function or __main__); give the Kernel a standalone= "
                         "source")
    partial = bool(args or keywords)
    imports, lines = ["import functools"] if partial else [], []
    user_file = getattr(module, "__file__", None)
    by_path = module_name.startswith("harness_user_kernels_") and user_file
    if by_path:
        path = str(Path(user_file).resolve())
        source = Path(path).read_text() if Path(path).is_file() else ""
        imports += ["import importlib.util"]
        if "harness" in source:
            imports += ["import types"]
            lines += [
                "if importlib.util.find_spec(\"harness\") is None:",
                "    # The file registers its kernel with attention-harness, which is not "
                "installed here:",
                "    # a stand-in whose register_kernel does nothing lets it load.",
                "    _harness = types.ModuleType(\"harness\")",
                "    _harness.register_kernel = lambda *args, **kwargs: None",
                "    sys.modules[\"harness\"] = _harness",
                "",
            ]
        lines += [
            "# The kernel's own file (given to the harness with --kernel-module), loaded by its "
            "path.",
            f"_KERNEL_FILE = {path!r}",
            f"_spec = importlib.util.spec_from_file_location({module_name!r}, _KERNEL_FILE)",
            "_kernel_module = importlib.util.module_from_spec(_spec)",
            "sys.modules[_spec.name] = _kernel_module",
            "_spec.loader.exec_module(_kernel_module)",
            f"_kernel_fn = _kernel_module.{qualname}",
        ]
    else:
        head, _, rest = qualname.partition(".")
        imports += [f"from {module_name} import {head} as _kernel_fn"]
        if rest:
            lines += [f"_kernel_fn = _kernel_fn.{rest}"]
    if partial:
        call = ", ".join([_literal(a) for a in args]
                         + [f"{k}={_literal(v)}" for k, v in keywords.items()])
        lines += [f"kernel = functools.partial(_kernel_fn, {call})"]
    else:
        lines += ["kernel = _kernel_fn"]
    needs_harness = not by_path and module_name.split(".")[0] == "harness"
    return "\n".join(imports) + "\n\n" + "\n".join(lines) + "\n", needs_harness


def _array_literal(a: np.ndarray, indent: str = "    ", width: int = 96) -> str:
    rows = []
    for row in a.tolist():
        text, line = [], indent + "["
        for i, x in enumerate(row):
            piece = f"{x}" + (", " if i < len(row) - 1 else "],")
            if len(line) + len(piece) > width:
                text.append(line.rstrip())
                line = indent + " "
            line += piece
        text.append(line)
        rows.append("\n".join(text))
    return "\n".join(rows)


def _number(x) -> str:
    if x is None:
        return "float(\"inf\")"
    x = float(x)
    return repr(x) if np.isfinite(x) else "float(\"inf\")"


_CHECK_WORDS = {
    "out": "the forward output",
    "dq": "the query gradient dq (jax.vjp, random output cotangent, zero at padding)",
    "dk": "the key gradient dk (jax.vjp, random output cotangent, zero at padding)",
    "dv": "the value gradient dv (jax.vjp, random output cotangent, zero at padding)",
    "leak": ("the leak probe: a segment's out, dq, dk and dv must stay bitwise the same when "
             "the rest of its row is redrawn"),
}

_INPUTS = '''
def draw_inputs():
    """Standard-normal q, k, v drawn from SEED and rounded to DTYPE (the draw attention-harness
    makes for this case). Padding positions hold larger values (x8) that a correct kernel never
    reads; the output cotangent (for gradients) is zero there."""
    dtype = jnp.dtype(DTYPE)
    rng = np.random.default_rng([SEED, @INPUT_SALT@])
    batch, seq = SEGMENT_IDS.shape
    valid = (SEGMENT_IDS > 0)[:, :, None, None]

    def draw(heads):
        x = rng.standard_normal((batch, seq, heads, HEAD_DIM), dtype=np.float32)
        poison = @POISON@ * rng.standard_normal(x.shape, dtype=np.float32)
        return np.where(valid, x, poison).astype(dtype)

    q, k, v = draw(HEADS), draw(KV_HEADS), draw(KV_HEADS)
    cotangent = (rng.standard_normal(q.shape, dtype=np.float32) * valid).astype(dtype)
    return q, k, v, cotangent


def kernel_under_test(q, k, v, segment_ids):
    return kernel(q, k, v, segment_ids, causal=CAUSAL, scale=SCALE, **KERNEL_KWARGS)
'''

_REFERENCE = '''
def reference_attention(q, k, v, segment_ids):
    """The float32 truth: dense softmax over the tokens of the same segment (and, causal, not
    after the query), HIGHEST matmul precision; padding queries give 0."""
    hi = jax.lax.Precision.HIGHEST
    q, k, v = (x.astype(jnp.float32) for x in (q, k, v))
    group = q.shape[2] // k.shape[2]               # GQA: query head h reads kv head h // group
    k, v = jnp.repeat(k, group, axis=2), jnp.repeat(v, group, axis=2)
    scores = jnp.einsum("bqhd,bkhd->bhqk", q * SCALE, k, precision=hi)
    seg_q, seg_k = segment_ids[:, :, None], segment_ids[:, None, :]
    mask = (seg_q == seg_k) & (seg_q > 0)
    if CAUSAL:
        t = segment_ids.shape[1]
        mask = mask & jnp.tril(jnp.ones((t, t), bool))[None]
    probs = jax.nn.softmax(jnp.where(mask[:, None], scores, -1e30), axis=-1)
    out = jnp.einsum("bhqk,bkhd->bqhd", probs, v, precision=hi)
    return jnp.where((segment_ids > 0)[:, :, None, None], out, 0.0)

'''

_CHECKED_OUT = '''
def checked(attention, q, k, v, segment_ids, cotangent):
    """The checked tensor: the forward output."""
    del cotangent
    return attention(q, k, v, segment_ids)
'''

_CHECKED_GRAD = '''
def checked(attention, q, k, v, segment_ids, cotangent):
    """The checked tensor: @CHECK@ of attention(q, k, v), through jax.vjp."""
    out, vjp = jax.vjp(lambda q, k, v: attention(q, k, v, segment_ids), q, k, v)
    return vjp(cotangent.astype(out.dtype))[@INDEX@]
'''

_TOLERANCE_MAIN = '''

def main():
    q, k, v, cotangent = draw_inputs()
    segment_ids = jnp.asarray(SEGMENT_IDS)
    got = jax.jit(lambda *a: checked(kernel_under_test, *a))(q, k, v, segment_ids, cotangent)
    f32 = [x.astype(np.float32) for x in (q, k, v, cotangent)]
    want = jax.jit(lambda q, k, v, s, ct: checked(reference_attention, q, k, v, s, ct))(
        f32[0], f32[1], f32[2], segment_ids, f32[3])
    got = np.asarray(jnp.asarray(got, jnp.float32))
    want = np.asarray(want)
    # Per token: the max abs error over heads and head dims (inf where not finite).
    err = np.where(np.isfinite(got), np.abs(got - want), np.inf).max(axis=(2, 3))

    device = jax.devices()[0]
    print(f"{KERNEL_NAME}: check {CHECK} on {CASE_ID}")
    print(f"jax {jax.__version__}, {device.platform} ({device.device_kind})")
    print(f"{'segment':8s} {'tokens':>11s} {'max abs err':>12s} {'tolerance*':>11s} {'ratio':>9s}"
          f" {'harness err':>12s}  verdict")
    failing = []
    for row, number, start, stop, tolerance, harness_err in SEGMENTS:
        seg_err = err[row, start:stop]
        worst = start + int(np.argmax(seg_err))
        value = float(seg_err.max())
        ratio = value / tolerance if tolerance > 0 else float("inf")
        bad = not value <= tolerance
        if bad:
            failing.append((f"r{row}s{number}", worst, ratio))
        verdict = f"FAIL (worst token {worst})" if bad else "ok"
        tokens = f"{start}..{stop - 1}"
        print(f"{f'r{row}s{number}':8s} {tokens:>11s} {value:12.4g} {tolerance:11.4g} "
              f"{ratio:9.3g} {harness_err:12.4g}  {verdict}")
    print("* tolerance: what attention-harness allowed this segment on this case (a multiple of"
          " the\\n  error of the same formula computed in the input dtype, plus a few eps of the"
          " largest value).")
    if failing:
        where = ", ".join(f"{label} (token {token}, {ratio:.3g}x the tolerance)"
                          for label, token, ratio in failing)
        print(f"@FAILED@ {CHECK} of {KERNEL_NAME} is wrong on {len(failing)} of {len(SEGMENTS)}"
              f" segments: {where}")
        return 1
    print(f"PASSED: {CHECK} of {KERNEL_NAME} is within tolerance on every segment")
    return 0
'''

_LEAK_MAIN = '''

def program(q, k, v, segment_ids, cotangent):
    """The kernel's out and, with a backward pass, dq, dk, dv (jax.vjp)."""
    if not BACKWARD:
        return (kernel_under_test(q, k, v, segment_ids),)
    out, vjp = jax.vjp(lambda q, k, v: kernel_under_test(q, k, v, segment_ids), q, k, v)
    return (out, *vjp(cotangent.astype(out.dtype)))


def perturbed(inputs, index, redraw):
    """The inputs with the `redraw` tokens' q, k, v and cotangent drawn afresh."""
    rng = np.random.default_rng([SEED, @PERTURB_SALT@, index])
    valid = (SEGMENT_IDS > 0)[redraw][:, None, None]
    arrays = []
    for i, x in enumerate(inputs):
        x = np.asarray(x)
        fresh = rng.standard_normal((int(redraw.sum()), *x.shape[2:]), dtype=np.float32)
        if i == 3:  # the cotangent stays zero at padding
            fresh = np.where(valid, fresh, 0)
        y = x.copy()
        y[redraw] = fresh.astype(x.dtype)
        arrays.append(y)
    return arrays


def main():
    names = ["out", "dq", "dk", "dv"] if BACKWARD else ["out"]
    q, k, v, cotangent = draw_inputs()
    segment_ids = jnp.asarray(SEGMENT_IDS)
    lowered = jax.jit(program).lower(q, k, v, segment_ids, cotangent)
    device = jax.devices()[0]
    # Bitwise comparisons need a reproducible build: XLA's deterministic ops on GPUs.
    compiled = (lowered.compile(compiler_options={"xla_gpu_deterministic_ops": True})
                if device.platform == "gpu" else lowered.compile())

    def run(q, k, v, ct):
        return [np.asarray(jnp.asarray(x, jnp.float32)) for x in compiled(q, k, v, segment_ids, ct)]

    def changed(a, b):  # [B, T]: any value of the token differs (NaN equal to NaN)
        return ((a != b) & ~(np.isnan(a) & np.isnan(b))).any(axis=(2, 3))

    valid = SEGMENT_IDS > 0
    base = run(q, k, v, cotangent)
    unstable = set()
    for _ in range(2):  # only what reproduces run to run on valid tokens can be probed
        again = run(q, k, v, cotangent)
        unstable |= {n for n, a, b in zip(names, base, again) if (changed(a, b) & valid).any()}
    probed = [i for i, n in enumerate(names) if n not in unstable]
    # The harness's groups: a checkerboard of segments (number + row), then the padding.
    colour = (SEGMENT_IDS + np.arange(SEGMENT_IDS.shape[0])[:, None]) % 2
    groups = [("segments of one colour", valid & (colour == 1)),
              ("segments of the other colour", valid & (colour == 0)), ("padding", ~valid)]
    runs = [(group, redraw, run(*perturbed((q, k, v, cotangent), index, redraw)))
            for index, (group, redraw) in enumerate(g for g in groups if g[1].any())]

    print(f"{KERNEL_NAME}: leak probe on {CASE_ID}")
    print(f"jax {jax.__version__}, {device.platform} ({device.device_kind})")
    if unstable:
        print(f"not reproducible run to run, not probed: {', '.join(sorted(unstable))}")
    failing = []
    for row, number, start, stop, harness_verdict in SEGMENTS:
        leaked, first, biggest, by = set(), [], 0.0, []
        for group, redraw, other in runs:
            if redraw[row, start:stop].any():
                continue  # this segment was redrawn in that run
            for i in probed:
                tokens = np.flatnonzero(changed(base[i], other[i])[row, start:stop])
                if tokens.size:
                    leaked.add(names[i])
                    first.append(start + int(tokens[0]))
                    change = np.abs(base[i] - other[i])[row, start:stop]
                    biggest = max(biggest, float(np.nanmax(change)))
                    by.append(group)
        label = f"r{row}s{number}"
        if leaked:
            failing.append(label)
            print(f"{label:8s} tokens {start}..{stop - 1}: LEAK in {', '.join(n for n in names if n in leaked)} "
                  f"(first token {min(first)}, max change {biggest:.4g}, redrawn: "
                  f"{', '.join(dict.fromkeys(by))}); harness: {harness_verdict}")
        else:
            print(f"{label:8s} tokens {start}..{stop - 1}: bitwise unchanged; "
                  f"harness: {harness_verdict}")
    if failing:
        print(f"@FAILED@ {KERNEL_NAME} leaks across segments on {len(failing)} of {len(SEGMENTS)}"
              f" segments: {', '.join(failing)}")
        return 1
    print(f"PASSED: no segment of {KERNEL_NAME} moves when the rest of its row is redrawn")
    return 0
'''

_FOOTER = '''

if __name__ == "__main__":
    sys.exit(main())
'''


def _comment(text: str, width: int = 98) -> list[str]:
    """Comment lines, each paragraph wrapped; continuation lines of an indented line align with
    its text after the first word ("  segment  r0s2 ..." continues under "r0s2")."""
    import re
    import textwrap
    out = []
    for para in text.split("\n"):
        m = re.match(r"^( +)(\S+ +)?", para)
        if m is None:
            indent = ""
        elif m.group(2) and len(m.group(1)) <= 2:
            indent = " " * m.end()
        else:
            indent = m.group(1)
        lines = textwrap.wrap(para, width - 2, break_long_words=False, break_on_hyphens=False,
                              subsequent_indent=indent, drop_whitespace=True) or [""]
        if m:  # textwrap keeps the first line's indent; restore it if dropped
            lines[0] = para[:len(m.group(1))] + lines[0].lstrip()
        out += ["#" + (" " + line if line else "") for line in lines]
    return out


def script_text(kernel: Kernel, original: Case, run: Run, check: str, runs: int,
                path: Path) -> tuple[str, bool]:
    """(the script, whether it needs the harness importable: a harness-defined kernel)."""
    import jax

    from harness.engine.environment import _version, git_state
    case = run.case
    failing = run.failing(check)
    worst = failing[0]
    source, needs_harness = kernel_source(kernel)
    commit, dirty = git_state()
    device = jax.devices()[0]
    label = f"r{worst['row']}s{worst['segment']}"
    tokens = f"{worst['start']}..{worst['start'] + worst['length'] - 1}"
    if check == LEAK.name:
        found = (f"changed by {_number(worst['max_abs_err'])} (bitwise probe, no tolerance) "
                 f"from token {worst['worst_token']}")
    else:
        ratio = "inf" if worst["ratio"] is None else f"{worst['ratio']:.3g}"
        err = "non-finite" if worst["max_abs_err"] is None else f"{worst['max_abs_err']:.4g}"
        found = (f"max abs err {err} against a tolerance of {worst['tolerance']:.4g} "
                 f"({ratio}x), worst at token {worst['worst_token']}")
    needs = "jax and numpy"
    if kernel.requires:
        needs += " (and " + ", ".join(kernel.requires) + ")"
    elif kernel.standalone is None:
        needs += " (and the kernel's own module, imported below)"
    header = ["#!/usr/bin/env python3"]
    header += _comment(
        f"Standalone reproduction: {kernel.name} fails the `{check}` check on a packed "
        "sequence (several documents per row told apart by int32 segment ids 1..M, 0 = padding)."
        "\n\n"
        f"What was found, by attention-harness (`python -m harness repro {kernel.name} "
        f"{original.id}`):\n"
        f"  kernel   {kernel.name}\n"
        f"  check    {check}: {_CHECK_WORDS[check]}\n"
        f"  segment  {label} (row {worst['row']}, segment {worst['segment']}, tokens {tokens}): "
        f"{found}\n"
        f"  case     {case.id}\n"
        f"           (batch {case.batch}, seq_len {case.seq_len}, heads {case.heads}, kv "
        f"heads {case.kv_heads}, head_dim {case.head_dim}, {case.dtype}, "
        f"{'causal' if case.causal else 'bidirectional'}, seed {case.seed})\n"
        f"  from     {original.id}, shrunk in {runs} kernel runs\n"
        f"  harness  git commit {commit or 'unknown'}"
        f"{' (with uncommitted changes)' if dirty else ''}\n"
        "\n"
        f"Run it with plain python; it needs {needs}:\n"
        f"    python {path.name}\n"
        "Exit status 1: the failure shows (a line starting with FAILED says where); 0: every "
        "segment passes (the kernel is fixed).\n"
        "\n"
        f"Made with Python {_platform.python_version()}, jax {jax.__version__}, jaxlib "
        f"{_version('jaxlib') or 'unknown'}, on {device.platform} ({device.device_kind}).\n"
        "\n"
        + ("The script draws the case's inputs from its seed with numpy (the harness's own "
           "draw), runs the kernel's out, dq, dk and dv, then runs it again with the other "
           "segments' and the padding's inputs redrawn: a segment whose results change at all "
           "reads tokens that are not its own."
           if check == LEAK.name else
           "The script draws the case's inputs from its seed with numpy (the harness's own "
           "draw), computes the checked tensor with the kernel and with a float32 reference "
           "(dense masked softmax, HIGHEST precision), and prints each segment's max abs error "
           "next to the tolerance the harness computed for that segment on this case."))
    seg_rows = []
    for seg in case.segments:
        rec = next(r for r in run.records if r["check"] == check and r.get("row") == seg.row
                   and r.get("segment") == seg.number)
        if check == LEAK.name:
            verdict = rec["verdict"]
            if verdict == "fail":
                verdict += f" ({rec['message']})"
            seg_rows.append(f"    ({seg.row}, {seg.number}, {seg.start}, {seg.stop}, "
                            f"{verdict!r}),")
        else:
            seg_rows.append(f"    ({seg.row}, {seg.number}, {seg.start}, {seg.stop}, "
                            f"{_number(rec['tolerance'])}, {_number(rec['max_abs_err'])}),")
    kwargs = {"max_segments": case.max_segments} if kernel.takes_max_segments else {}
    if check == LEAK.name:
        seg_comment = "\n".join(_comment(
            "Per segment: row, segment number, first token, end (exclusive), and the harness's "
            "leak-probe verdict on this case."))
    else:
        chk = CHECKS[check]
        seg_comment = "\n".join(_comment(
            "Per segment: row, segment number, first token, end (exclusive), then two numbers "
            f"the harness computed on this case: the tolerance it judged the segment's `{check}` "
            f"by ({chk.peer_factor:g} x the error of the same formula computed in {case.dtype}, "
            f"plus {chk.floor_eps:g} eps x the largest |{check}| of the case"
            + (f", x{FLOAT32_FLOOR_FACTOR:g} in float32" if case.dtype == "float32" else "")
            + "), and the max abs error it measured for the kernel."))
    case_block = "\n".join([
        "# ----- the case (shrunk by attention-harness) "
        + "-" * 52,
        f"KERNEL_NAME = {kernel.name!r}",
        f"CHECK = {check!r}",
        f"CASE_ID = {case.id!r}",
        "# int32 [batch, seq]: the segments of each row numbered 1..M, 0 = padding",
        "SEGMENT_IDS = np.array([",
        _array_literal(case.segment_ids),
        "], dtype=np.int32)",
        f"HEADS, KV_HEADS, HEAD_DIM = {case.heads}, {case.kv_heads}, {case.head_dim}",
        f"DTYPE = {case.dtype!r}",
        f"CAUSAL = {case.causal!r}",
        f"SCALE = {case.scale!r}  # 1 / sqrt(HEAD_DIM)",
        f"SEED = {case.seed!r}",
        f"KERNEL_KWARGS = {kwargs!r}",
        *([f"BACKWARD = {kernel.backward!r}"] if check == LEAK.name else []),
        seg_comment,
        "SEGMENTS = [",
        *seg_rows,
        "]",
    ])
    if check == "out":
        checked = _CHECKED_OUT
    elif check == LEAK.name:
        checked = ""
    else:
        index = [c.name for c in TENSORS].index(check) - 1
        checked = _CHECKED_GRAD.replace("@CHECK@", check).replace("@INDEX@", str(index))
    imports = ["import os", "import sys", "",
               "# Transformer Engine reads this while tracing: its deterministic algorithms, "
               "for bitwise\n# comparisons.",
               "os.environ.setdefault(\"NVTE_ALLOW_NONDETERMINISTIC_ALGO\", \"0\")", ""] \
        if check == LEAK.name else ["import sys", ""]
    imports += ["import jax", "import jax.numpy as jnp", "import numpy as np"]
    main_source = (_LEAK_MAIN if check == LEAK.name else _TOLERANCE_MAIN).replace(
        "@FAILED@", FAILED_MARK)
    chunks = [
        "\n".join(header) + "\n\n" + "\n".join(imports),
        "# ----- the kernel under test: kernel(query, key, value, segment_ids, *, causal, scale)"
        " --------\n# MaxText layout: [batch, seq, heads, head_dim]; the output is shaped like "
        "the query.\n" + source,
        case_block,
        "# ----- inputs" + ("" if check == LEAK.name else ", reference and the checked tensor")
        + " " + "-" * (85 - (0 if check == LEAK.name else 34)) + "\n" + _INPUTS,
        *([] if check == LEAK.name else [_REFERENCE, checked]),
        main_source,
        _FOOTER,
    ]
    text = "\n\n\n".join(c.strip("\n") for c in chunks) + "\n"
    from harness.model.case import INPUT_SALT, PADDING_POISON_SCALE
    from harness.judge.leak_probe import PERTURB_SALT
    for mark, value in (("@INPUT_SALT@", hex(INPUT_SALT)), ("@POISON@", repr(PADDING_POISON_SCALE)),
                        ("@PERTURB_SALT@", hex(PERTURB_SALT))):
        text = text.replace(mark, value)
    compile(text, str(path), "exec")
    return text, needs_harness


# ----- checking the script -------------------------------------------------------------------------

def verify(path: Path, needs_harness: bool) -> tuple[int | None, str]:
    """Runs the script with plain python in an empty folder; (exit status, output). The
    environment's PYTHONPATH loses every entry that holds this harness, unless the kernel itself
    is harness code."""
    env = dict(os.environ)
    entries = [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p]
    entries = [p for p in entries if not (Path(p) / "harness" / "__init__.py").is_file()]
    if needs_harness:
        entries.insert(0, str(REPO_ROOT))
    if entries:
        env["PYTHONPATH"] = os.pathsep.join(entries)
    else:
        env.pop("PYTHONPATH", None)
    with tempfile.TemporaryDirectory(prefix="repro-check-") as cwd:
        try:
            done = subprocess.run([sys.executable, str(path.resolve())], cwd=cwd, env=env,
                                  capture_output=True, text=True, timeout=VERIFY_TIMEOUT_S)
        except subprocess.TimeoutExpired as exc:
            out = (exc.stdout or "") if isinstance(exc.stdout, str) else ""
            return None, out + f"\n(timed out after {VERIFY_TIMEOUT_S} s)"
    return done.returncode, done.stdout + done.stderr


def reproduced(code: int | None, output: str) -> bool:
    return code == 1 and any(line.startswith(FAILED_MARK) for line in output.splitlines())


# ----- the command -------------------------------------------------------------------------------

def default_output(kernel_name: str) -> str:
    return "repro_" + kernel_name.replace(":", "_").replace("/", "_") + ".py"


def main(args) -> int:
    from harness.engine.environment import current_platform
    from harness.engine.programs import Programs
    from harness.engine.registry import select_kernels

    kernel = select_kernels([args.kernel])[0]
    try:
        original = Case.from_id(args.case_id)
        original.segments  # noqa: B018  (a layout that cannot make this shape raises here)
    except ValueError as exc:
        raise UsageError(f"case {args.case_id!r}: {exc}") from None
    check = getattr(args, "check", None)
    if check is not None and check not in CHECKS:
        raise UsageError(f"--check {check}: unknown check; known: {', '.join(CHECKS)}")
    kernel_source(kernel)  # refuse a kernel the script could not load, before any work
    output = Path(getattr(args, "output", None) or default_output(kernel.name))

    def log(line: str) -> None:
        print(line, file=sys.stderr, flush=True)

    start = time.perf_counter()
    programs = Programs()
    try:
        runner = Runner(kernel, current_platform(), programs)
        first = target_check(runner, original, check)
        check = runner.check
        log(f"{kernel.name} fails {check} on {original.id}; shrinking")
        # The same case as custom rows (the same inputs: they depend on shape, seed and ids).
        start_case = as_custom(original)
        start_run = runner.fails(start_case, check) if start_case is not None else None
        if start_run is None:
            start_run = first  # a layout's case the custom form does not reproduce: start there
        shrunk = shrink(runner, start_run, check, log)
    finally:
        programs.close()
    elapsed = time.perf_counter() - start
    worst = shrunk.failing(check)[0]
    text, needs_harness = script_text(kernel, original, shrunk, check, runner.runs, output)
    output.parent.mkdir(parents=True, exist_ok=True)
    output.write_text(text)
    label = f"r{worst['row']}s{worst['segment']}"
    stop = worst["start"] + worst["length"] - 1
    if check == LEAK.name:
        numbers = f"changed by {worst['max_abs_err']:.4g} when other tokens were redrawn"
    else:
        ratio = "inf" if worst["ratio"] is None else f"{worst['ratio']:.3g}"
        err = "non-finite" if worst["max_abs_err"] is None else f"{worst['max_abs_err']:.4g}"
        numbers = f"max abs err {err}, tolerance {worst['tolerance']:.4g}, ratio {ratio}"
    print(f"original case: {original.id}")
    print(f"shrunk case:   {shrunk.case.id}  ({runner.runs} kernel runs, {elapsed:.1f} s)")
    print(f"failing:       check {check}, segment {label} (row {worst['row']}, tokens "
          f"{worst['start']}..{stop}): {numbers}")
    print(f"script:        {output}")
    code, out = verify(output, needs_harness)
    if reproduced(code, out):
        print(f"checked:       `python {output}` exits 1 (the failure shows)")
        return 0
    print(f"warning: `python {output}` did not reproduce the failure (exit status {code}):",
          file=sys.stderr)
    print("\n".join(out.rstrip().splitlines()[-20:]), file=sys.stderr)
    return 1

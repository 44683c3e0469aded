"""What a kernel is, and what it declares it supports.

A kernel is `fn(query, key, value, segment_ids, *, causal, scale) -> output`, MaxText layout
[batch, seq, heads, head_dim], output shaped like the query. Its capabilities decide which
cases it runs: a combination it does not declare is skipped with the reason; a kernel that
raises on a combination it declares is an error, never a skip.
"""
from __future__ import annotations

import dataclasses
import importlib.util
import re
from collections.abc import Callable
from dataclasses import dataclass, field

from harness.judge import judging
from harness.judge import vocabulary as v
from harness.model.case import Case
from harness.model.layouts import Segment

ALL_DTYPES = ("float32", "bfloat16", "float16")
# The dtypes an output may have where it is not the query's (Kernel.output_dtype).
OUTPUT_DTYPES = ("float32", "bfloat16", "float16", "float64")
# Declarations that are tuples of names, and those that are True or False (Kernel._check_types).
NAMES_FIELDS = ("dtypes", "devices", "hlo_markers", "backward_markers", "forward_markers",
                "requires", "tags", "features")
FLAG_FIELDS = ("gqa", "packed", "causal_only", "padding_anywhere", "backward", "forward_mode",
               "materializes_scores", "takes_max_segments")


def _positive_int(x) -> bool:
    return isinstance(x, int) and not isinstance(x, bool) and x > 0

# expect(case, check name, segment) -> "pass" | "fail" | "either" | ("either", reason) |
# ("known", reason): what a correct harness must conclude ("either": not judged by that check;
# the leak probe then must judge the segment, see judging.cover_unjudged; "known": a named
# upstream numerical bug that fails on some data only, reported as known when it does).
Expectation = Callable[[Case, str, Segment], object]
# expect_padding(case, row) -> "pass" | "fail": what the padding check must conclude on a row
# (a kernel meant to read padding keys writes gradients there).
PaddingExpectation = Callable[[Case, int], object]


# What an isolation group's name may hold: it names its workers' folders, `<name>-<attempt>`
# (harness.engine.workers).
ISOLATION_NAME = r"[A-Za-z0-9_.-]+"

@dataclass(frozen=True)
class Platform:
    name: str                      # "cpu" or "gpu"
    compute_capability: float | None = None
    memory_bytes: int | None = None  # what one program may use on the device; None: unknown
    device_count: int = 1          # devices this process sees (a sharded kernel's mesh)


@dataclass(frozen=True, eq=False)
class Kernel:
    """A kernel and its capabilities (the fields below; see the module docstring).

    `isolation` names a process group: kernels of different non-None groups must not share a
    process, because their libraries clash once both are imported there (flash-attn-jax and
    flash-attn3-jax register FFI targets of the same names, and the second import fails), so a
    runner gives each group worker processes of its own. None: the kernel shares any process.
    """
    name: str
    fn: Callable
    dtypes: tuple[str, ...] = ALL_DTYPES
    head_dims: tuple[int, ...] | None = None   # None: any head dim
    gqa: bool = True
    packed: bool = True
    causal_only: bool = False
    # Takes padding before or between segments (left padding; TE's pad_between_seqs). Kernels
    # built on MaxText's convention (padding only after the last segment) leave this False.
    padding_anywhere: bool = False
    devices: tuple[str, ...] = ("cpu", "gpu")
    min_compute_capability: float | None = None
    # Devices the kernel's mesh spans (harness.kernels.sharded): fewer visible is a skip.
    min_devices: int = 1
    backward: bool = True
    # Its library offers forward mode (jax.jvp through it: a JVP rule of its own, or jax's
    # autodiff of plain jax): the output's tangent for random input tangents is checked per
    # segment against the oracle's (check jvp). False: no jvp check (jax.jvp through a
    # custom_vjp raises). A kernel that declares it and raises under jax.jvp is an error, but
    # where the trace refuses a feature the case hands over (a refused jvp check).
    forward_mode: bool = False
    # Custom calls that must appear in its forward-mode program (as hlo_markers for the
    # default one: its library's JVP kernel); () where jax's autodiff of plain jax is the rule.
    forward_markers: tuple[str, ...] = ()
    # Its forward-mode rule's own limits, narrower than the kernel's (fa4-jax's JVP kernel takes
    # head dims <= 128): reasons the jvp check cannot run on a case, which is then a skip of
    # that check with them (the other checks run).
    forward_limits: "Callable[[Case], list[str]] | None" = None
    requires: tuple[str, ...] = ()             # importable modules, checked lazily
    seq_len_multiple: int | None = None
    # Builds the [batch, heads, seq, seq] float32 scores in memory (dense kernels): cases whose
    # scores (and their gradient) would not fit the device are skipped with the size.
    materializes_scores: bool = False
    # Environment under which the kernel's library picks deterministic algorithms while it is
    # traced (Transformer Engine: NVTE_ALLOW_NONDETERMINISTIC_ALGO=0): its deterministic build
    # for the leak probe is traced afresh under it (harness.engine.programs).
    deterministic_env: dict[str, str] | None = None
    # Pass max_segments (static): for kernels configured like MaxText's max_segments_per_seq.
    takes_max_segments: bool = False
    # Anything else a kernel cannot do: (case, platform) -> reasons (empty when it can).
    constraints: Callable[[Case, Platform], list[str]] | None = None
    expect: Expectation | None = None
    # Known upstream failure: the kernel must raise an error containing this text. It is then
    # recorded as "known" (not bad); if it stops raising, that is reported as "missed".
    expect_error: "str | Callable[[Case], str | None] | None" = None
    # Custom-call names that must appear in the compiled program: proof that the fused kernel
    # ran, so a silent fallback cannot pass as it.
    hlo_markers: tuple[str, ...] = ()
    # Those of hlo_markers that only its backward pass holds: a build of its forward alone
    # (where its backward refused a feature: harness.engine.refusal) must hold the others.
    backward_markers: tuple[str, ...] = ()
    # Python source that defines `kernel(query, key, value, segment_ids, *, causal, scale,
    # max_segments=None)` with nothing but jax, numpy and the kernel's own library: what
    # `python -m harness repro` writes into a standalone script. None: the script imports `fn`.
    standalone: str | None = None
    # Process group: kernels of different non-None groups never share a process (docstring).
    isolation: str | None = None
    description: str = ""
    tags: tuple[str, ...] = field(default=())
    # What the kernel writes at padding positions: "zero", "finite" (any finite value) or
    # "undefined" (not looked at). Gradients there must be exactly zero whatever it declares.
    padding_output: str = v.PAD_FINITE
    expect_padding: PaddingExpectation | None = None
    # The output's dtype where it is not the query's (None: the query's, the contract).
    output_dtype: str | None = None
    # False: the library says its backward is not reproducible run to run, and no setting
    # changes that (atomics): the leak probe never trusts a bitwise rerun of it and decides
    # statistically (harness.judge.leak_probe). None: find out by rerunning (where a
    # perturbation moved a token that must not move).
    reproducible: bool | None = None
    # The attention features its API takes (harness.model.features): each is handed over as a
    # keyword argument (window=(left, right), softcap=, chunk=, sinks=array[heads]; head_dim_v
    # by the value's shape). A case with a feature it does not take is skipped; one it takes it
    # must honour (judged) or refuse while tracing, naming it.
    features: tuple[str, ...] = ()
    # Where its library documents another convention than the harness's (chunks from the row's
    # start: {"chunk": "row"}); it is judged against what it documents, and records say so.
    conventions: dict = field(default_factory=dict)

    def __post_init__(self):
        from harness.model.features import CHUNK, CHUNK_CONVENTIONS, FEATURE_NAMES
        self._check_types()
        unknown = [f for f in self.features if f not in FEATURE_NAMES]
        if unknown:
            raise ValueError(f"features {unknown}: unknown; known: {', '.join(FEATURE_NAMES)}")
        if self.conventions.get(CHUNK, "segment") not in CHUNK_CONVENTIONS:
            raise ValueError(f"conventions[{CHUNK!r}] must be one of "
                             f"{', '.join(CHUNK_CONVENTIONS)}")
        if self.expect_error is not None and not callable(self.expect_error) and not (
                isinstance(self.expect_error, str) and self.expect_error.strip()):
            raise ValueError(f"expect_error {self.expect_error!r}: the text the error's message "
                             "holds (every message holds an empty one), a function of the case, "
                             "or None")
        wrong = [d for d in self.devices if d not in ("cpu", "gpu", "tpu")]
        if wrong:
            raise ValueError(f"devices {tuple(self.devices)}: {', '.join(map(repr, wrong))} is "
                             "not a jax platform name (cpu, gpu, tpu: lowercase)")
        if self.forward_markers and not self.forward_mode:
            raise ValueError("forward_markers without forward_mode: the markers of a forward-"
                             "mode program the kernel does not declare")
        if self.forward_mode and self.hlo_markers and not self.forward_markers:
            raise ValueError("forward_mode with hlo_markers and no forward_markers: name the "
                             "custom calls its forward-mode program must hold, or a fallback "
                             "would pass as the fused path")
        if self.isolation is not None and not re.fullmatch(ISOLATION_NAME, self.isolation):
            # It names its workers' folders (harness.engine.workers): a "/" would nest them.
            raise ValueError(f"isolation {self.isolation!r}: letters, digits, '_', '.' and '-' "
                             "only (it names the group's worker folders)")
        if self.isolation == "main" or (self.isolation or "").startswith("main."):
            raise ValueError(f"isolation {self.isolation!r}: 'main' is the group of the kernels "
                             "without one, and 'main.*' its parts: name the group otherwise")
        if self.padding_output not in v.PADDING_OUTPUTS:
            raise ValueError(f"padding_output must be one of {', '.join(v.PADDING_OUTPUTS)}, "
                             f"not {self.padding_output!r}")

    def _check_types(self) -> None:
        """Declarations of the wrong type, named: a lone string where names are due would be
        read letter by letter (hlo_markers="te_fused" would look for "t", "e", ... and let a
        fallback pass as the fused path)."""
        for name in NAMES_FIELDS:
            value = getattr(self, name)
            if isinstance(value, str):
                raise ValueError(f"{name} {value!r}: a tuple of names, not one string (read "
                                 f"letter by letter); write ({value!r},)")
            if not isinstance(value, (tuple, list)) or not all(
                    isinstance(x, str) and x for x in value):
                raise ValueError(f"{name} {value!r}: a tuple of non-empty strings")
        unknown = set(self.dtypes) - set(ALL_DTYPES)
        if unknown:
            raise ValueError(f"unknown dtypes {sorted(unknown)}")
        if self.head_dims is not None and (
                isinstance(self.head_dims, (str, int)) or not self.head_dims
                or not all(_positive_int(d) for d in self.head_dims)):
            raise ValueError(f"head_dims {self.head_dims!r}: a tuple of positive whole numbers, "
                             "or None (any head dim)")
        for name in ("min_devices", *(["seq_len_multiple"] if self.seq_len_multiple is not None
                                      else [])):
            if not _positive_int(getattr(self, name)):
                raise ValueError(f"{name} {getattr(self, name)!r}: a positive whole number")
        for name in FLAG_FIELDS:
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{name} {getattr(self, name)!r}: True or False")
        if self.reproducible is not None and not isinstance(self.reproducible, bool):
            raise ValueError(f"reproducible {self.reproducible!r}: True, False or None")
        if self.output_dtype is not None and self.output_dtype not in OUTPUT_DTYPES:
            raise ValueError(f"output_dtype {self.output_dtype!r}: one of "
                             f"{', '.join(OUTPUT_DTYPES)}, or None (the query's)")

    def forward_only(self) -> Kernel:
        """The kernel without its backward pass: the markers its forward holds."""
        return dataclasses.replace(self, backward=False, backward_markers=(), hlo_markers=tuple(
            m for m in self.hlo_markers if m not in self.backward_markers))

    @property
    def chunk_convention(self) -> str:
        """Where its chunks start (harness.model.features: the segment's start by default)."""
        return self.conventions.get("chunk", "segment")

    def unsupported_reasons(self, case: Case, platform: Platform) -> list[str]:
        reasons = []
        missing = [f for f in case.features.names if f not in self.features]
        if missing:
            reasons.append(f"does not take {', '.join(missing)} (its API has no argument for "
                           f"{'them' if len(missing) > 1 else 'it'})")
        if platform.name not in self.devices:
            reasons.append(f"runs on {'/'.join(self.devices)}, not {platform.name}")
        if (self.min_compute_capability is not None and platform.name == "gpu"
                and (platform.compute_capability or 0) < self.min_compute_capability):
            reasons.append(f"needs compute capability >= {self.min_compute_capability}, "
                           f"device has {platform.compute_capability}")
        if platform.device_count < self.min_devices:
            reasons.append(f"needs {self.min_devices} devices, {platform.device_count} visible")
        if case.dtype not in self.dtypes:
            reasons.append(f"dtype {case.dtype} not in {'/'.join(self.dtypes)}")
        if self.head_dims is not None and case.head_dim not in self.head_dims:
            reasons.append(f"head_dim {case.head_dim} not in {self.head_dims}")
        if case.gqa and not self.gqa:
            reasons.append(f"no GQA/MQA ({case.heads} heads over {case.kv_heads} kv heads)")
        if case.packed and not self.packed:
            reasons.append("no packed segments")
        if not case.causal and self.causal_only:
            reasons.append("causal only")
        if case.padding_inside and not self.padding_anywhere:
            reasons.append("padding before or between segments (kernel takes padding only "
                           "after the last segment)")
        if self.seq_len_multiple and case.seq_len % self.seq_len_multiple:
            reasons.append(f"seq_len {case.seq_len} not a multiple of {self.seq_len_multiple}")
        if self.materializes_scores and platform.memory_bytes:
            need = scores_bytes(case)
            if need > platform.memory_bytes:
                reasons.append(f"dense scores need {need / 2**30:.0f} GiB, more than the "
                               f"{platform.memory_bytes / 2**30:.0f} GiB this device allows")
        if self.constraints is not None:
            reasons += self._reasons(self.constraints, "constraints(case, platform)", case,
                                     platform)
        reasons += [f"optional dependency {module!r} is not installed"
                    for module in self.missing_requirements()]
        return reasons

    def missing_requirements(self) -> list[str]:
        """The modules of `requires` that this Python cannot import."""
        return [m for m in self.requires if importlib.util.find_spec(m.split(".")[0]) is None]

    def forward_reasons(self, case: Case) -> list[str]:
        """Why the jvp check cannot run on `case` (forward_limits), or []."""
        return self._reasons(self.forward_limits, "forward_limits(case)", case) \
            if self.forward_limits else []

    def _call(self, fn, call: str, case: Case, *more):
        """One of the kernel's own declarations called on a case (constraints, forward_limits,
        expect, expect_padding, expect_error): one that raises is its author's mistake, one
        line naming the kernel, the function and the case."""
        from harness.errors import USER_CODE_RAISED, UsageError
        try:
            return fn(case, *more)
        except USER_CODE_RAISED as exc:   # sys.exit and pytest.skip too: not a clean exit
            raise UsageError(f"kernel {self.name}: {call} raised on {case.id}: "
                             f"{type(exc).__name__}: {exc}") from None

    def _reasons(self, fn, call: str, case: Case, *more) -> list[str]:
        """What a kernel's own function of the case says against it (constraints,
        forward_limits): a list of reasons. One that raises or returns anything else is its
        author's mistake: one line naming the kernel, the function and the case."""
        from harness.errors import UsageError
        value = self._call(fn, call, case, *more)
        if not isinstance(value, (list, tuple)) or not all(isinstance(x, str) for x in value):
            raise UsageError(f"kernel {self.name}: {call} returned {value!r} on {case.id}: it "
                             "must return a list of reasons (strings), [] where the case runs")
        return list(value)

    def expected(self, case: Case, check: str, segment: Segment | None) -> tuple[str, str]:
        """(expected, reason): what this kernel must show on that check of that segment; of a
        check with no segment (dsinks), `expect(case, check, None)`: a kernel that takes sinks
        and has an expectation answers for segment None."""
        call = f"expect(case, {check!r}, {None if segment is None else segment.label})"
        value = self._call(self.expect, call, case, check, segment) if self.expect else v.PASS
        return self._expectation(value, check, call)

    def error_expected(self, case: Case) -> str | None:
        """The upstream error this kernel declares on `case` (expect_error: a text, or a
        function of the case for an error some cases raise), or None."""
        if not callable(self.expect_error):
            return self.expect_error
        text = self._call(self.expect_error, "expect_error(case)", case)
        if text is not None and not (isinstance(text, str) and text.strip()):
            # "" is in every message: it would make any crash of the kernel a known one.
            from harness.errors import UsageError
            raise UsageError(f"kernel {self.name}: expect_error(case) returned {text!r} on "
                             f"{case.id}: it must return the text the error's message holds, "
                             "or None where no error is expected")
        return text

    def expected_padding(self, case: Case, row: int) -> tuple[str, str]:
        """(expected, reason): what the padding check must show on that row."""
        call = f"expect_padding(case, {row})"
        value = self._call(self.expect_padding, call, case, row) if self.expect_padding \
            else v.PASS
        return self._expectation(value, v.PADDING.name, call)

    def _expectation(self, value, check: str, call: str) -> tuple[str, str]:
        """A wrong expectation is the kernel's author's mistake: one line naming it."""
        try:
            return judging.expectation(value, check)
        except ValueError as exc:
            from harness.errors import UsageError
            raise UsageError(f"kernel {self.name}: {call} returned {value!r}: {exc}") from None


def scores_bytes(case: Case) -> int:
    """Peak memory of a dense kernel's fwd+bwd: scores, probabilities and their gradient in
    float32, [batch, heads, seq, seq] each."""
    return 4 * 4 * case.batch * case.heads * case.seq_len ** 2

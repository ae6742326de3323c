"""Which kernel each linear layer uses on this machine: measured once, cached, shown by `gpt2 info --kernels`.

    from gpt2.kernels import plan_for
    plan = plan_for(model, "int8")   # first time on this machine: measures (seconds); then read from the cache
    print(plan.describe())

    gpt2 info --kernels gpt2 --kernels-dtype bfloat16   # the choice and the timings behind it
    gpt2 generate --model gpt2 --dtype int4 --verbose "Hello"

Nothing is assumed about the CPU. For each linear shape (out, in) of the model (GELU-fused or not)
and the precision asked for, every weight format quantize.py offers is packed from a random weight,
and each of its paths is
  1. checked against the float64 product of the weights that format computes with (a path outside
     its precision's rounding, as a kernel with a layout bug would be, is rejected), then
  2. timed at 1 row (decode), 8 rows (batched decode), 64 rows (short: a short prompt, 33-127 rows),
     128 rows (prefill) and 512 rows (long: a long prompt or a server's prefill chunk, from 256 rows),
     keeping the fastest of a few repeats (other work only adds time). Decode and batch call the
     layers in turn, as a decode step does (a precision's layers are measured together, in the
     model's order: a block's linears, then the lm_head), over enough copies that a round exceeds the
     cache this process gets (measured once: effective_cache_bytes), so they read memory as a real
     model does; short, prefill and long are bound by FLOPs and use one copy.
Per format, each regime takes its fastest path. The format kept is, among those within 5% of the fastest
at decode (a generated token costs a decode call; a prompt is paid once), the one whose regimes are,
summed, closest to the best of each (time / best time, added over the five regimes). A combined format
(WeightFormat.parts: int8's two u8s8 engines in one layer, bf16's F.linear and fbgemm weights) is not
measured itself: its timings are its parts', and it replaces the format kept where it makes some regime
COMBINED_GAIN faster (its parts slower at decode are then still timed at every other regime, on the
paths it takes from them).

What keeps measuring to seconds (GPT-2 124M on 2 cores, a fresh cache, on an Intel Xeon with AMX whose
effective cache measured 64 MiB: float32 2.0 s, bf16 1.3 s, int8 2.4 s, int4 3.4 s; BENCHMARKS.md): a
precision's layers share one rotation, in every format (a round reads the other formats' copies too,
untimed, by their readers), so each needs copies for its share of it only: int8's three formats need
none beside the packed one, where a block alone in one format needed 19 and the lm_head alone 4 (int4's
int8 lm_head, in a turn of its own, needs 2); each regime is measured across every format before the
next, formats slower at decode stop there, and a path that provably cannot win in its format is
skipped (_may_win); a path two formats share on the same tensors is measured once
(WeightFormat.same_weights_as); paths that dequantize the whole weight per call are timed only at 64,
128 and 512 rows; a layer wider than WIDE_OUTPUTS (the lm_head) times those three regimes on its
leading outputs and scales the times by its width; checks compare the edges of long calls and wide
layers against one float64 reference per distinct weight, and at 64, 128 and 512 rows the check's
call is the first sample. What is left is timing and packing the weights once (int8: 0.5 s of 2.4
packing, cProfile; int4: 0.9 s of 3.3, its lm_head packed twice for each u8s8 engine, at 0.39 s for
fbgemm and 0.12 s for oneDNN). A plain read of a spacer buffer instead ranked kernel families further
from the model than copies (benchmarks/ab_plans.py runs plans in the model; BENCHMARKS.md); the
readers are the layers' own kernels on their own copies, and every block layer kept the format and
paths that copies alone had chosen.

The KV cache's dtype is chosen here too (kv_cache_dtype, for load_for_inference's kv_dtype="auto"): bf16
where the keys are bf16 numbers already and one-query attention over a bf16 cache measures no slower;
timed apart for the eager step (PyTorch's SDPA) and for a compiled one (Inductor's own loops, which
upcast as they read), whose choices differ on an AMD EPYC Zen 4.

Results are cached per CPU model and features, torch version, thread count, the ISA limits set in the
environment (ISA_VARIABLES: ONEDNN_MAX_CPU_ISA=AVX2 is another machine) and candidate list, in
$XDG_CACHE_HOME/gpt2/kernels.json (default ~/.cache), written atomically. A corrupt or foreign file
is ignored with one warning and measured again. A measurement taken while other processes held more
than BUSY_SHARE of the CPUs is kept with a warning and taken again at the next load, until one is taken
on a quiet machine or BUSY_MEASUREMENTS were taken; the quietest of them is kept (_keep_quietest).
"""

from __future__ import annotations

import json
import logging
import math
import os
import platform
import time
import types
from collections.abc import Callable
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

import torch

from gpt2.atomic import atomic_write_json
from gpt2.quantize import (CPU_FORMATS, KV_DTYPES, REGIMES, WEIGHT_BYTES, WeightFormat, _Packed,
                           formats_for, kernel_dtype, layer_precision, linear_layers, path_args)

log = logging.getLogger(__name__)

CACHE_VERSION = 20 # 2: decode copies own their storage (version 1 timed float32 plain cache-hot); 3: "long";
                   # 4: the bf16 oneDNN format keeps only its packed weight (no float32-GEMM path);
                   # 5: entries keyed by the layer's own precision (int4 and int8 plans share the int8 lm_head);
                   # 6: int4's "dequant bf16" writes a (K, N) weight and fuses bias and GELU; paths cast their
                   # own input and return their kernel's dtype (int8's u8s8 no longer rounds x to bf16 first);
                   # 7: "short" (33-127 rows, timed at 64); 8: decode's copies span 2x the measured cache
                   # (effective_cache_bytes), not 2x what sysfs says (480 MiB on a Xeon VM: ~30 s to measure);
                   # the format is chosen decode first (_choose); the check's first call is never the
                   # only sample (_time_in_turn); 9: int4's "dequant bf16" works in blocks of DEQUANT_BLOCK weights;
                   # 10: the decode span counts a copy as the weight at its precision's width (_copies);
                   # 11: int8's two-engine format (WeightFormat.parts; _choose_combined); 12: int4's
                   # "dequant bf16" reads AVX2's and plain CPUs' packing too (quantize.int4pack_layout);
                   # 13: decode and batch call a block's layers in turn (measure_shapes), not one shape alone;
                   # 14: and the lm_head after them (_turns), not alone; 15: every format's copies are read in
                   # every round (_reader), so they share the span; 16: int4's "dequant fp32" (MKL's GEMM);
                   # 17: bf16's oneDNN format has a float32-GEMM path for many rows (_onednn_upcast); a path
                   # skipped at prefill is still timed at long where short shows it may win there (_may_win);
                   # 18: int4's dequant paths multiply the whole weight in one GEMM (quantize._dequant_buffer);
                   # 19: a combined format's parts slower at decode are timed at every regime after it, not
                   # at batch only (_parts_to_time); 20: int4's dequant paths write q - 8 in the weight's
                   # (K, N) order into a buffer the thread keeps (quantize._levels_in_k_order)
# The files cached_measurement keeps (training.json, lm_head.json, cpu_cache.json) carry their own version:
# a change to the kernel plans above leaves them valid.
MEASUREMENT_CACHE_VERSION = 5
ROWS = {"decode": 1, "batch": 8, "short": 64, "prefill": 128, "long": 512}  # the rows each regime is timed at
TOLERANCE = {"float32": 1e-5, "bfloat16": 2 ** -7, "int8": 2 ** -7, "int4": 2 ** -7}  # relative, see _check
REPEATS = 5
LONG_SAMPLE_S = 0.1  # a call this long is timed once (_time_in_turn)
FEATURE_FLAGS = ("avx2", "avx512f", "avx512_bf16", "avx512_vnni", "avx_vnni", "amx_bf16", "amx_int8", "amx_tile")
# Variables that narrow what the libraries run on this CPU (ATen's and Inductor's vector ISA, oneDNN's, MKL's)
# or change their arithmetic (oneDNN's implicit bf16 for float32): a plan or graph made under them is another
# machine's (measured and compiled apart: machine_key).
ISA_VARIABLES = ("ATEN_CPU_CAPABILITY", "ONEDNN_MAX_CPU_ISA", "DNNL_MAX_CPU_ISA", "ONEDNN_DEFAULT_FPMATH_MODE",
                 "DNNL_DEFAULT_FPMATH_MODE", "MKL_ENABLE_INSTRUCTIONS", "MKL_CBWR")


# ---------------------------------------------------------------------------------------------
# the machine
# ---------------------------------------------------------------------------------------------

def cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def cpu_features() -> list[str]:
    """The CPU flags that decide kernels (bf16, VNNI, AMX), as /proc/cpuinfo lists them."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags"):
                flags = set(line.split(":", 1)[1].split())
                return [f for f in FEATURE_FLAGS if f in flags]
    except OSError:
        pass
    return []


def last_level_cache_bytes() -> int:
    """The largest CPU cache (L3 usually), from sysfs; 64 MiB when it can't be read."""
    sizes = []
    for index in Path("/sys/devices/system/cpu/cpu0/cache").glob("index*"):
        try:
            text = (index / "size").read_text().strip()
        except OSError:
            continue
        unit = {"K": 1024, "M": 1024 ** 2, "G": 1024 ** 3}.get(text[-1:], 1)
        sizes.append(int(text.rstrip("KMG")) * unit)
    return max(sizes, default=64 * 1024 ** 2)


def effective_cache_bytes() -> int:
    """How many bytes read again are still found in cache, measured once per machine (then cached).

    sysfs gives the whole last-level cache, which a VM shares with other tenants: an Intel Xeon here
    reports 480 MiB, yet a 128 MiB buffer already reads at memory speed (19 vs 48 GB/s at 64 MiB).
    Buffers of 4, 8, 16 MiB ... up to the sysfs size are summed again and again and set against one
    of twice that size (at least 256 MiB); the largest read at least 1.5x faster is the answer.
    At least 4 MiB: below that a machine has no cache worth the name, or the measurement failed."""
    def measure() -> dict:
        limit = last_level_cache_bytes()
        cold = _read_rate(max(2 * limit, 256 * 1024 ** 2))
        size, found = 4 * 1024 ** 2, 4 * 1024 ** 2
        while size <= limit:
            if _read_rate(size) < 1.5 * cold:
                break
            found, size = size, 2 * size
        return {"bytes": found}

    result, _ = cached_measurement("cpu_cache", {"kind": "effective cache"}, measure,
                                   validate=lambda entry: int(entry["bytes"]))
    return int(result["bytes"])


def _read_rate(nbytes: int, repeats: int = 3) -> float:
    """Bytes per second of a sum over an nbytes buffer read again (one warm-up pass, best of `repeats`)."""
    x = torch.ones(nbytes // 4)
    x.sum()
    return nbytes / min(_timed(x.sum) for _ in range(repeats))


def memory_bandwidth_gbs(megabytes: int = 512) -> float:
    """Read bandwidth of a plain sum over a buffer far larger than the caches, in GB/s (best of 5)."""
    return _read_rate(megabytes * 1024 ** 2, repeats=5) / 1e9


def machine_key() -> dict:
    """What a measurement or a compiled graph holds for: the CPU, torch, the threads, and the ISA_VARIABLES
    set (named only when set, so that a plain run's key is as it was)."""
    key = {"cpu": cpu_model(), "features": cpu_features(), "torch": torch.__version__,
           "threads": torch.get_num_threads()}
    limits = {name: os.environ[name] for name in ISA_VARIABLES if name in os.environ}
    return {**key, "isa limits": limits} if limits else key


def _timed(fn) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


# ---------------------------------------------------------------------------------------------
# the plan: one choice per linear shape
# ---------------------------------------------------------------------------------------------

@dataclass
class Choice:
    format: str
    paths: dict[str, str]                                # regime -> path
    timings_us: dict[str, dict[str, dict[str, float]]]   # format -> path -> regime -> microseconds
    rejected: dict[str, str] = field(default_factory=dict)  # "format/path" -> why
    turn: list[str] = field(default_factory=list)  # the shapes decode and batch were timed with, in turn


@dataclass
class Plan:
    precision: str
    machine: dict
    choices: dict[str, Choice]   # shape_key -> choice
    source: str = "measured"     # or "cache"
    # The share of the CPUs other processes took while the choices were measured: now (source "measured"),
    # or, for choices kept from a busy machine, then; and how many busy measurements were taken of them.
    busy_share: float | None = None
    busy_measurements: int = 0

    def choice_for(self, out_features: int, in_features: int, activation: str | None,
                   precision: str | None = None) -> Choice:
        return self.choices[shape_key(out_features, in_features, activation, precision or self.precision,
                                      self.precision)]

    def choices_dict(self) -> dict:
        return {"machine": self.machine, "source": self.source,
                "choices": {k: {"format": c.format, "paths": c.paths, "timings_us": c.timings_us,
                                "rejected": c.rejected, "turn": c.turn} for k, c in self.choices.items()}}

    def describe(self) -> str:
        m = self.machine
        lines = [f"kernels for {self.precision} on {m['cpu']} ({', '.join(m['features']) or 'no bf16/VNNI/AMX flags'}; "
                 f"torch {m['torch']}, {m['threads']} threads), {self.source}"
                 + (f", measured while other processes took {100 * self.busy_share:.0f}% of the CPUs ("
                    + ("measured again at the next load" if self.busy_measurements < BUSY_MEASUREMENTS else
                       f"the quietest of {self.busy_measurements} such measurements; `gpt2 cache --clear "
                       "measurements` measures again") + ")"
                    if (self.busy_share or 0) > BUSY_SHARE else "") + ":"]
        for key, c in self.choices.items():
            lines.append(f"  {key}: {c.format}  " + "  ".join(f"{r}={c.paths[r]}" for r in REGIMES))
            if len(c.turn) > 1:
                turn = " -> ".join(c.turn)
                lines.append(f"      decode and batch timed in turn, as a decode step calls them: {turn} "
                             "(each round also reads the other formats' copies, untimed)")
            for fmt, paths in c.timings_us.items():
                for path, t in paths.items():
                    lines.append(f"      {fmt:>18} / {path:<13} " + "  ".join(
                        f"{r} {t[r]:8.1f} us" if r in t else f"{r} {'-':>8}   " for r in REGIMES))
            lines += [f"      {why}" for why in _why_not(c)]
            for what, why in c.rejected.items():
                lines.append(f"      rejected {what}: {why}")
        return "\n".join(lines)


def _why_not(choice: Choice) -> list[str]:
    """Why each format measured was not kept (the rule: _choose); nothing for a plan not measured."""
    if not choice.timings_us:
        return []

    times = _decode_times(choice.timings_us)

    def decode(fmt):
        return times.get(fmt, math.inf)
    combined = next((f for f in CPU_FORMATS if f.name == choice.format and f.parts), None)
    lines, held = [], set()
    if combined is not None:  # a combined format: what it gains over the part _choose kept alone
        alone = Choice(_choose(choice.timings_us, {}).format, {}, choice.timings_us)
        gain, regime = _combined_gain(combined, alone)
        held = set(combined.parts)
        lines.append(f"kept: {choice.format}, {gain:.2f}x {alone.format}'s speed at {regime} (at least "
                     f"{COMBINED_GAIN}x for one more packed copy of the weight)")
    kept = min((decode(f) for f in held), default=decode(choice.format))
    fastest = min(times.values(), default=math.inf)
    for fmt in choice.timings_us:
        if fmt == choice.format or fmt in held:
            continue
        if decode(fmt) > DECODE_SLACK * fastest:
            lines.append(f"not kept: {fmt}, {decode(fmt) / fastest:.2f}x the fastest decode")
        else:
            slack = 100 * (DECODE_SLACK - 1)
            lines.append(f"not kept: {fmt}, within {slack:.0f}% at decode ({decode(fmt) / kept:.2f}x "
                         f"{choice.format}'s) but further from the best of the other regimes")
    return lines


def shape_key(out_features: int, in_features: int, activation: str | None, precision: str, plan_precision: str) -> str:
    """"3072x768+gelu_tanh"; a layer kept at another precision than its plan's says so ("50257x768@int8")."""
    return (f"{out_features}x{in_features}" + (f"+{activation}" if activation else "")
            + (f"@{precision}" if precision != plan_precision else ""))


def default_cache_path() -> Path:
    from gpt2.user_cache import default_cache_dir
    return default_cache_dir() / "kernels.json"


def plan_for(model, precision: str, device_type: str | None = None, cache_path: Path | None = None) -> Plan:
    """The kernels for every linear of `model` at `precision`: cached choices, measuring what is missing.

    Only the model's shapes are read (a model on the meta device will do, with device_type="cpu").
    """
    device_type = device_type or model.transformer.wte.weight.device.type
    shapes = {}  # key -> (precision, out, in, activation)
    for _, attr, l, act in linear_layers(model):
        p = layer_precision(precision, attr)
        shapes[shape_key(l.out_features, l.in_features, act, p, precision)] = (p, l.out_features, l.in_features, act)
    if device_type != "cpu":  # one format per precision off the CPU: nothing to measure
        def fixed(p):
            fmt = formats_for(p, device_type)[0]
            return Choice(fmt.name, {r: next(iter(fmt.paths)) for r in REGIMES}, {})
        return Plan(precision, {"cpu": device_type, "features": [], "torch": torch.__version__, "threads": 0},
                    {k: fixed(p) for k, (p, *_) in shapes.items()}, "fixed")
    machine = machine_key()
    cache_path = cache_path or default_cache_path()
    entries, busy = _read_cache(cache_path)
    entry_keys = {key: _entry_key(machine, *shape) for key, shape in shapes.items()}
    missing = [key for key, entry in entry_keys.items() if entry not in entries or _measure_again(busy, entry)]
    source, busy_share = "cache", None
    if missing:
        with others_cpu_share() as cpus:
            measured = {}
            for turn in _turns(missing, shapes):
                for key, choice in zip(turn, measure_shapes(shapes[turn[0]][0], [shapes[key][1:] for key in turn])):
                    measured[entry_keys[key]] = asdict(choice)
        for entry, choice in measured.items():
            _keep_quietest(entries, busy, entry, choice, cpus.share)
        _write_cache(cache_path, entries, busy)
        source, busy_share = "measured", cpus.share
    marks = [busy[entry] for entry in entry_keys.values() if entry in busy]  # choices kept from a busy machine
    busy_measurements = max((mark["measurements"] for mark in marks), default=0)
    if source == "measured":
        warn_if_busy(cpus, f"the {precision} kernels were measured", _measured_again(busy_measurements))
    if marks:
        busy_share = max(mark["share"] for mark in marks)
    choices = {key: Choice(**entries[entry]) for key, entry in entry_keys.items()}
    return Plan(precision, machine, choices, source, busy_share, busy_measurements)


# A measurement is only as good as the machine was quiet: where other processes (or, on a VM, its host:
# steal time) took more than this share of the CPUs while one ran, a slower kernel may have been timed
# faster. Such a measurement is kept, marked in the cache with the share, and taken again at the next
# load: a quiet one replaces it; a busy one replaces it only if quieter. After BUSY_MEASUREMENTS in all
# the quietest stays, so that a machine that is never quiet (a loaded CI runner, a VM's noisy host) pays
# for measuring a few times, not at every load.
BUSY_SHARE = 0.25
BUSY_MEASUREMENTS = 3


def _measure_again(busy: dict, entry: str) -> bool:
    """Whether a cache entry was measured on a busy machine and may be measured again."""
    return entry in busy and busy[entry]["measurements"] < BUSY_MEASUREMENTS


def _keep_quietest(entries: dict, busy: dict, entry: str, result, share: float | None) -> None:
    """Records result, measured while other processes took `share` of the CPUs, at entries[entry] unless
    an earlier measurement there was taken on a quieter machine; busy[entry] = {share, measurements}
    marks an entry kept from a busy measurement. A share of None (unknown) counts as quiet."""
    before = busy.get(entry)
    if share is None or share <= BUSY_SHARE:
        entries[entry] = result
        busy.pop(entry, None)
        return
    measurements = (before["measurements"] if before else 0) + 1
    if before is None or entry not in entries or share <= before["share"]:
        entries[entry] = result
        busy[entry] = {"share": share, "measurements": measurements}
    else:
        busy[entry] = {**before, "measurements": measurements}


class others_cpu_share:
    """with others_cpu_share() as busy: ...; busy.share is then the fraction of all the CPUs' time that
    went to other processes (and steal) meanwhile, from /proc/stat less the CPU time of this process and
    of the processes it started (a compile's C++ compilers and worker pool: its own work, not load);
    None where /proc/stat cannot be read (not Linux) or the interval was too short to tell.

    Its descendants' time comes from a scan of /proc (~1 ms). With scan_at_entry=False, for a caller that
    seldom reads the share (a compiled step, which compiles at few of its calls), nothing is scanned unless
    .share is read, which should then be at once (descendants that end before the read are missed); a
    descendant's time before the interval counts as this process's own work (the share can only come out
    lower)."""

    def __init__(self, scan_at_entry: bool = True):
        self.scan_at_entry = scan_at_entry

    def __enter__(self):
        self._share, self._end = None, None
        self._start = (time.perf_counter(), _process_cpu_seconds(), _cpu_busy_seconds(),
                       _descendants_cpu_seconds() if self.scan_at_entry else 0.0)
        return self

    def __exit__(self, *exc):
        self._end = (time.perf_counter(), _process_cpu_seconds(), _cpu_busy_seconds())
        if self.scan_at_entry:
            self._settle()  # the descendants read now, at the interval's end
        return False

    @property
    def share(self) -> float | None:
        self._settle()
        return self._share

    def _settle(self) -> None:
        if self._end is not None and self._share is None:
            (wall, own, busy, descendants), (wall_end, own_end, busy_end) = self._start, self._end
            wall, self._end = wall_end - wall, None
            if busy is not None and busy_end is not None and wall >= 0.2:  # /proc/stat counts in 10 ms ticks
                own = own_end - own + _descendants_cpu_seconds() - descendants
                others = busy_end - busy - own  # every CPU's busy seconds, less this process's and its own
                self._share = min(1.0, max(0.0, others / (wall * (os.cpu_count() or 1))))


def _process_cpu_seconds() -> float:
    """CPU seconds of this process and of the children it waited for."""
    times = os.times()
    return times.user + times.system + times.children_user + times.children_system


def _descendants_cpu_seconds() -> float:
    """CPU seconds of this process's live descendants, with the children each of those waited for, from
    /proc; 0.0 where /proc cannot be read."""
    try:
        pids = [int(name) for name in os.listdir("/proc") if name.isdigit()]
    except OSError:
        return 0.0
    parents, cpu, tick = {}, {}, os.sysconf("SC_CLK_TCK")
    for pid in pids:
        try:
            with open(f"/proc/{pid}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()  # after "pid (comm)": the name may hold spaces
        except (OSError, IndexError):
            continue  # exited meanwhile
        # fields[1]: ppid; fields[11:15]: utime, stime, cutime, cstime in clock ticks
        parents[pid] = int(fields[1])
        cpu[pid] = sum(int(x) for x in fields[11:15]) / tick
    children: dict[int, list[int]] = {}
    for pid, parent in parents.items():
        children.setdefault(parent, []).append(pid)
    total, stack = 0.0, list(children.get(os.getpid(), []))
    while stack:
        pid = stack.pop()
        total += cpu[pid]
        stack += children.get(pid, [])
    return total


def _cpu_busy_seconds() -> float | None:
    """Seconds all CPUs spent busy (user, nice, system, irq, softirq, steal) since boot, from /proc/stat."""
    try:
        with open("/proc/stat") as f:
            fields = f.readline().split()
    except OSError:
        return None
    if not fields or fields[0] != "cpu":
        return None
    user, nice, system, _idle, _iowait, irq, softirq, steal = (int(x) for x in fields[1:9])
    return (user + nice + system + irq + softirq + steal) / os.sysconf("SC_CLK_TCK")


def warn_if_busy(busy: others_cpu_share, what: str, then: str) -> None:
    """A warning where other processes took more than BUSY_SHARE of the CPUs while `what` ran (kernels
    were timed), saying what follows (`then`)."""
    if busy.share is not None and busy.share > BUSY_SHARE:
        log.warning("other processes took %.0f%% of the CPUs while %s: a slower kernel may have been timed "
                    "faster; %s", 100 * busy.share, what, then)


def _measured_again(measurements: int) -> str:
    """What follows the measurements'th busy measurement of a cache entry (_keep_quietest)."""
    if measurements < BUSY_MEASUREMENTS:
        return "it is measured again at the next load"
    return (f"after {measurements} such measurements the quietest is kept (`gpt2 cache --clear measurements` "
            "measures again)")


def _turns(keys: list[str], shapes: dict) -> list[list[str]]:
    """The layers measured together (measure_shapes), of shapes' key -> (precision, out, in, activation):
    all of a precision's layers, in the model's order, as a decode step calls them: a block's linears
    (twelve times over in GPT-2 124M), then the lm_head. A rotation that reads the lm_head too spans the
    cache with fewer copies of each layer (int8 in one format: 3, not 19 for a block and 4 for the lm_head
    alone; in all three formats at once, _add_cold_copies, none beside the packed one)."""
    turns = {}
    for key in keys:
        turns.setdefault(shapes[key][0], []).append(key)
    return list(turns.values())


def _entry_key(machine: dict, precision: str, out_features: int, in_features: int, activation: str | None) -> str:
    """A cache entry's key: the machine, the candidates measured and the layer's own precision and shape, so
    that an int4 plan and an int8 one share the measured int8 lm_head."""
    candidates = [f"{f.name}/{path}" for f in formats_for(precision, "cpu") for path in f.paths]
    return (json.dumps({**machine, "candidates": candidates}, sort_keys=True)
            + f"|{shape_key(out_features, in_features, activation, precision, precision)}@{precision}")


def _read_cache(path: Path, validate=lambda entry: Choice(**entry), version: int = CACHE_VERSION) -> tuple[dict, dict]:
    """The cache's entries and its marks of the entries measured on a busy machine (_keep_quietest);
    ({}, {}) (after one warning) for a corrupt or foreign file, which is then rewritten."""
    if not path.exists():
        return {}, {}
    try:
        data = json.loads(path.read_text())
        if data.get("version") != version or not isinstance(data.get("entries"), dict):
            raise ValueError(f"cache version {data.get('version')!r}, this gpt2 reads version {version}")
        for entry in data["entries"].values():
            validate(entry)  # every entry must have the expected fields
        busy = data.get("busy", {})  # absent in files written before busy measurements were taken again
        for mark in busy.values():
            float(mark["share"]), int(mark["measurements"])
        return data["entries"], busy
    except (OSError, ValueError, TypeError, AttributeError, KeyError) as e:
        log.warning("ignoring the kernel cache %s (%s); measuring again", path, e)
        return {}, {}


def _write_cache(path: Path, entries: dict, busy: dict, version: int = CACHE_VERSION) -> None:
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        atomic_write_json(path, {"version": version, "entries": entries, "busy": busy})
    except OSError as e:  # a read-only home still runs; it measures again next time
        log.warning("could not write the kernel cache %s: %s", path, e)


def cached_measurement(name: str, key: dict, measure, validate=lambda entry: None) -> tuple[dict, str]:
    """measure() -> a JSON-able dict, once per machine and key (in NAME.json beside the kernel cache);
    afterwards read back. Returns (result, "measured" or "cache"). Training's dtype choice uses it."""
    path = default_cache_path().with_name(f"{name}.json")
    entries, busy = _read_cache(path, validate, MEASUREMENT_CACHE_VERSION)
    full_key = json.dumps({**machine_key(), **key}, sort_keys=True)
    if full_key in entries and not _measure_again(busy, full_key):
        return entries[full_key], "cache"
    with others_cpu_share() as cpus:
        result = measure()
    _keep_quietest(entries, busy, full_key, result, cpus.share)
    _write_cache(path, entries, busy, MEASUREMENT_CACHE_VERSION)
    measurements = busy.get(full_key, {}).get("measurements", 0)
    warn_if_busy(cpus, f"the {name} choices were measured", _measured_again(measurements))
    return entries[full_key], "measured"


# ---------------------------------------------------------------------------------------------
# measuring one shape
# ---------------------------------------------------------------------------------------------

@dataclass
class Candidate:
    """One weight format packed for the shape being measured: its tensors, cold copies and reference."""
    format: WeightFormat
    tensors: dict
    copies: list[dict]
    expected: Expected
    bias: torch.Tensor  # in the kernel dtype
    twin: WeightFormat | None  # the candidate format.same_weights_as names (measured before this one)
    reader: Callable | None = None  # reads its cold copies while other paths are timed (_reader)


# Short, prefill and long are bound by FLOPs, and their time grows with a layer's width: a layer wider than
# this (the lm_head: 50,257 outputs, a 512-row call 0.1-0.3 s per path) times them on its first
# WIDE_OUTPUTS outputs, plus its width modulo 64 (so that a partial block stays partial), and scales
# the times up by the width. Decode and batch, bound by memory, always time the whole layer.
WIDE_OUTPUTS = 8192
COLD_REGIMES = ("decode", "batch")  # timed over cold copies; the others over one warm copy


def runs_at(fmt: WeightFormat, path: str, regime: str) -> bool:
    """Whether a format's path is measured (and may be chosen) at a regime: a one-row path at decode
    only, a path that dequantizes the whole weight per call never at decode or batch."""
    return not ((regime != "decode" and path in fmt.one_row_paths)
                or (regime in COLD_REGIMES and path in fmt.many_row_paths))


def _is_wide(out_features: int) -> bool:
    return out_features > WIDE_OUTPUTS + out_features % 64


@dataclass
class _Layer:
    """One linear shape being measured: its random weight's candidates, the inputs, and what was found."""
    shape: tuple  # (out_features, in_features, activation)
    weight: torch.Tensor  # (out, in) float32, random; bias (out,)
    bias: torch.Tensor
    inputs: dict  # regime -> (ROWS[regime], in_features) in the kernel dtype
    whole: dict  # format name -> Candidate for the whole layer, with its cold copies (decode, batch)
    narrow: dict  # format name -> Candidate for short, prefill and long (a wide layer's leading outputs)
    scale: float  # out_features / the narrow candidates' outputs
    rejected: dict = field(default_factory=dict)  # "format/path" -> why
    timings: dict = field(default_factory=dict)  # format -> path -> regime -> us


def measure_shape(precision: str, out_features: int, in_features: int, activation: str | None) -> Choice:
    """measure_shapes for one layer alone."""
    return measure_shapes(precision, [(out_features, in_features, activation)])[0]


@torch.inference_mode()
def measure_shapes(precision: str, shapes: list[tuple[int, int, str | None]]) -> list[Choice]:
    """Check and time every format and path for each linear shape (out, in, activation); keep the best format
    of each (see the docstring). The shapes are layers a decode step calls one after another (a block's, in
    the model's order): decode and batch call a path on each of them in turn, over cold copies.

    Every format is packed first and the regimes are measured in turn, each across all formats. After
    decode, only the formats _choose may keep (within DECODE_SLACK of the fastest there) go on, and
    within each of them a path is skipped once another of its paths has shown it cannot win (_may_win);
    at decode and batch a path that some layer needs is timed on every layer it runs on, so that each
    round still reads the whole block."""
    layers = [_layer(precision, shape) for shape in shapes]
    _add_cold_copies(layers)
    span = 2 * effective_cache_bytes()  # what a round reads (over its copies) before a copy is read again
    formats = [f for f in formats_for(precision, "cpu") if not f.parts]  # a combined format: through its parts
    combined = [f for f in formats_for(precision, "cpu") if f.parts]
    for regime in REGIMES:  # decode first: it decides which formats go on (_fast_at_decode)
        cold = regime in COLD_REGIMES
        running = {id(layer): None if regime == "decode" else _fast_at_decode(layer.timings) for layer in layers}
        parts_only = {id(layer): _parts_to_time(combined, running[id(layer)]) for layer in layers}
        for fmt in formats:
            # the format's first path that runs at this regime is always timed (_may_win), and the next
            # where it failed its check there, so that every format covers every regime (a one-row path
            # comes first in int8's and runs at decode only)
            first = next((name for name in fmt.paths if runs_at(fmt, name, regime)), None)
            for name, path in fmt.paths.items():
                if not runs_at(fmt, name, regime):
                    continue
                key = f"{fmt.name}/{name}"
                due, turn = [], []  # the layers that need this path timed; those it is timed on
                for layer in layers:
                    c = (layer.whole if cold else layer.narrow).get(fmt.name)
                    if c is None or key in layer.rejected:
                        continue
                    twin = c.twin.name if c.twin is not None and c.twin.paths.get(name) is path else None
                    if twin is not None and name != first and (
                            f"{twin}/{name}" in layer.rejected or regime in layer.timings.get(twin, {}).get(name, {})):
                        # the same kernel on the same tensors, checked or timed in the twin format: reuse its result
                        if f"{twin}/{name}" in layer.rejected:
                            layer.rejected[key] = layer.rejected[f"{twin}/{name}"]
                            layer.timings.get(fmt.name, {}).get(name, {}).pop(regime, None)
                        else:
                            elapsed = layer.timings[twin][name][regime]
                            layer.timings.setdefault(fmt.name, {}).setdefault(name, {})[regime] = elapsed
                        continue
                    own = {fmt.name: layer.timings.get(fmt.name, {})}  # a path competes with its own format's
                    runs, parts = running[id(layer)], parts_only[id(layer)]
                    # the first path, or the next where none before it passed its check at this regime
                    uncovered = name == first or not any(regime in t for t in own[fmt.name].values())
                    if ((runs is None or fmt.name in runs or name in parts.get(fmt.name, ()))
                            and _may_win(regime, own[fmt.name].get(name, {}), own, always=uncovered)):
                        due.append(layer)
                    turn.append(layer)
                if due:
                    _measure_path(fmt, name, path, regime, turn if cold else due, layers, span)
    choices = []
    for layer in layers:
        timings = {f: paths for f, paths in layer.timings.items() if paths}
        if not timings:
            out, inn, _ = layer.shape
            raise RuntimeError(f"no {precision} kernel passed its check for {out}x{inn}: {layer.rejected}")
        choices.append(_choose_combined(_choose(timings, layer.rejected), combined))
    turn = [shape_key(*shape, precision, precision) for shape in shapes]
    return [replace(choice, turn=turn) for choice in choices]


def _layer(precision: str, shape: tuple) -> _Layer:
    """A layer's random weight (the same for a shape wherever it is measured), packed in every format
    (the cold copies follow: _add_cold_copies)."""
    out_features, in_features, activation = shape
    gen = torch.Generator().manual_seed(0)
    w = torch.randn(out_features, in_features, generator=gen) * 0.02
    bias = torch.randn(out_features, generator=gen) * 0.02
    dtype = kernel_dtype(precision)
    inputs = {r: torch.randn(n, in_features, generator=gen).to(dtype) for r, n in ROWS.items()}
    rejected = {}
    whole = _candidates(precision, w, bias, activation, rejected, inputs["decode"])
    if _is_wide(out_features):
        narrow_outputs = WIDE_OUTPUTS + out_features % 64
        narrow = _candidates(precision, w[:narrow_outputs], bias[:narrow_outputs], activation, rejected)
    else:
        narrow, narrow_outputs = whole, out_features
    return _Layer(shape, w, bias, inputs, {c.format.name: c for c in whole}, {c.format.name: c for c in narrow},
                  out_features / narrow_outputs, rejected)


def _add_cold_copies(layers: list[_Layer]) -> None:
    """Gives each whole candidate with a reader its cold copies: as many as make one round, which reads
    every layer in every such format once, span twice the cache (_copies). A round reads the timed path's
    copies and, by their readers, other formats' (_measure_path), so the formats share the span: int8's
    three need one copy each (the packed one) where each alone needed three."""
    read = sum(layer.weight.numel() for layer in layers for c in layer.whole.values() if c.reader is not None)
    for layer in layers:
        for c in layer.whole.values():
            if c.reader is not None:
                c.copies = _copies(c.format, layer.weight, layer.bias, c.tensors, read)


def _measure_path(fmt, name: str, path, regime: str, layers: list[_Layer], turn_layers: list[_Layer],
                  span: float) -> None:
    """Check one path at a regime on each of `layers`, then time it where it passed: at decode and batch
    on those layers in turn over their cold copies (_time_in_turn), each round followed by other
    candidates' readers (of turn_layers: all that measure_shapes measures) until the rounds read `span`
    bytes, the span the copies were made for; at short, prefill and long on each layer's one copy, whose check call is
    the warm-up and first sample. Results go into the layers."""
    cold = regime in COLD_REGIMES
    key, passed, seconds = f"{fmt.name}/{name}", [], []
    for layer in layers:
        c = (layer.whole if cold else layer.narrow)[fmt.name]
        why, checked = _check(path, c.tensors, c.bias, layer.shape[2], c.expected, layer.inputs[regime],
                              fmt.activation_levels.get(name))
        if why:  # not taken from this regime on; where it passed at fewer rows, it may still be taken there
            layer.rejected[key] = f"{why} (not taken from {regime} on)"
            layer.timings.get(fmt.name, {}).get(name, {}).pop(regime, None)
        else:
            passed.append(layer)
            seconds.append(checked)
    own = [_best({fmt.name: layer.timings.get(fmt.name, {})}, regime) for layer in passed]
    if cold:
        turn = [(layer.whole[fmt.name].copies, layer.whole[fmt.name].bias, layer.shape[2], layer.inputs[regime])
                for layer in passed]
        # The readers a round needs: with n copies, a copy is read again n rounds later, so a round must
        # read span / n bytes (the timed calls' own and the rest); past that they would only cost time
        # (GPT-2 124M's float32 layers in its four formats, one copy each, are 5.4x the span of a 64 MiB cache).
        rounds = len(turn[0][0]) if turn else 1
        missing = span / rounds - sum(_weight_bytes(layer.weight, fmt) for layer in passed)
        readers, timed = [], {id(layer) for layer in passed}
        for layer in turn_layers:
            for c in layer.whole.values():
                if c.reader is not None and missing > 0 and not (c.format.name == fmt.name and id(layer) in timed):
                    readers.append((c.reader, c.copies, c.bias, layer.shape[2], layer.inputs["decode"]))
                    missing -= _weight_bytes(layer.weight, c.format)
        elapsed = _time_in_turn(path, turn, own, readers=readers) if turn else []
    else:
        elapsed = [layer.scale * _time_in_turn(
                       path, [(layer.narrow[fmt.name].copies[:1], layer.narrow[fmt.name].bias, layer.shape[2],
                               layer.inputs[regime])], [best / layer.scale], [first])[0]
                   for layer, best, first in zip(passed, own, seconds)]
    for layer, t in zip(passed, elapsed):
        layer.timings.setdefault(fmt.name, {}).setdefault(name, {})[regime] = 1e6 * t


def _parts_to_time(combined: list[WeightFormat], running: set[str] | None) -> dict[str, set[str]]:
    """Formats slower at decode that a combined format (WeightFormat.parts) holds beside one that goes
    on: timed at every regime after decode too, on the paths the combined format takes from them (its
    reason to exist: on an AMD EPYC Zen 4, fbgemm's fp16 GEMM reads bf16's weights twice as fast as
    F.linear at 1 row, and F.linear's bf16 GEMM is 1.4-3.4x as fast at 64-512 rows; BENCHMARKS.md)."""
    extra = {}
    for fmt in combined if running is not None else ():
        if running & set(fmt.parts):
            for part, names in fmt.parts.items():
                others = {name for other, its in fmt.parts.items() if other != part for name in its.values()}
                if part not in running:  # its own paths only: one another part has too is timed there
                    extra.setdefault(part, set()).update(path for path, name in names.items() if name not in others)
    return extra


def _candidates(precision: str, w: torch.Tensor, bias: torch.Tensor, activation: str | None, rejected: dict,
                reader_input: torch.Tensor | None = None) -> list[Candidate]:
    """Every format of the precision packed from w (N, K), with its reference; a format whose packing
    fails goes into `rejected`. reader_input (one row): also find each one's reader (_reader), for the
    candidates decode and batch time over cold copies."""
    dtype = kernel_dtype(precision)
    b = bias.to(dtype)
    candidates = []
    for fmt in formats_for(precision, "cpu"):
        if fmt.parts:  # measured through its parts
            continue
        twin = next((c for c in candidates if c.format.name == fmt.same_weights_as), None)
        try:
            if twin is not None and fmt.repack is not None:  # the twin's quantized weight, packed for this format
                tensors = fmt.repack(twin.tensors)
            else:
                tensors = fmt.pack(w, bias)
        except RuntimeError as e:
            rejected[fmt.name] = f"pack failed: {str(e).splitlines()[0][:120]}"
            continue
        if twin is not None and fmt.repack is not None:
            expected = twin.expected  # the twin's q and scales, cloned: the same weight, by construction
        else:
            expected = Expected(fmt, w, tensors, b.double(), activation, precision)
            # Formats computing with one weight (int8's three) share one: its products are the costly part of a check.
            expected = next((c.expected for c in candidates if c.expected.same_as(expected)), expected)
        reader = None if reader_input is None else _reader(fmt, tensors, b, activation, reader_input)
        candidates.append(Candidate(fmt, tensors, [tensors], expected, b, None if twin is None else twin.format,
                                    reader))
    return candidates


def _reader(fmt: WeightFormat, tensors: dict, b: torch.Tensor, activation: str | None, x: torch.Tensor):
    """The format's first decode path that runs on these tensors (its result is not looked at): it reads
    the format's cold copies in a round where another format's path is timed, as a decode step reads the
    layers around the one timed. None where no decode path runs."""
    for name, path in fmt.paths.items():
        if runs_at(fmt, name, "decode"):
            try:
                path(x, path_args(tensors), b, activation)
                return path
            except (RuntimeError, NotImplementedError):
                continue
    return None


def _copies(fmt, w, bias, tensors, round_weights: int | None = None) -> list[dict]:
    """Enough packed copies of one weight that a rotation reading round_weights weights a round (every
    layer's of the turn in every format, _add_cold_copies; default: this one's) spans twice the cache this
    process gets, the first size that effective_cache_bytes found read at memory speed (decode reads
    memory): each copy is read again only after the others have pushed it out, as a model's weights are.
    A weight's size is its bytes as stored (WEIGHT_BYTES), what a decode call reads: the
    tensors' own sizes mislead. MKL's packed tensor claims 2.6x the weight's bytes: counted so, 8 copies
    spanned under the cache, and MKL timed 154 us for 2304x768 float32 (47 GB/s, on a Xeon whose memory
    reads 20-28), 300 us past it, and the same in a model's decode as a plain F.linear."""
    nbytes = (round_weights or w.numel()) * WEIGHT_BYTES[fmt.precision]
    n = max(1, min(64, math.ceil(2 * effective_cache_bytes() / max(nbytes, 1))))
    # Each copy owns its storage: a format that keeps the weight as it is (float32 plain) would otherwise
    # hand back the same storage every time, which then stays in cache and times as ~4x faster. Plain
    # tensors are cloned (packing again would quantize again); an engine's packed object is made again
    # from cloned q and scales (fmt.repack); oneDNN's opaque tensors are packed again, as a clone may
    # not keep their layout.
    if all(_is_plain(t) for t in tensors.values()):
        return [tensors] + [{k: t.clone() if isinstance(t, torch.Tensor) else t for k, t in tensors.items()}
                            for _ in range(n - 1)]
    if fmt.repack is not None:
        return [tensors] + [fmt.repack(tensors) for _ in range(n - 1)]
    return [tensors] + [fmt.pack(w.clone(), bias.clone()) for _ in range(n - 1)]


def _weight_bytes(w: torch.Tensor, fmt: WeightFormat) -> float:
    """What a decode call of the format reads of weight w: its bytes as stored (WEIGHT_BYTES; int4's scales
    and zeros included)."""
    return w.numel() * WEIGHT_BYTES[fmt.precision]


def _is_plain(t) -> bool:
    """A strided tensor, or metadata a format keeps beside its tensors (int4pack's row count)."""
    if isinstance(t, _Packed):
        return not isinstance(t.obj, torch.ScriptObject)
    return t.layout == torch.strided


# A check compares a long call's first and last rows, and a wide layer's first and last outputs: the
# float64 reference of all 512 rows of the lm_head's 50,257 outputs would cost seconds per format. A
# layout bug sits at the edges (a partial block of rows or columns) or everywhere.
CHECKED_ROWS = 64
CHECKED_COLUMNS = 2048


def _edges(n: int, keep: int) -> torch.Tensor:
    """Indices of the first and last `keep` of n (all of them when n <= 2 keep)."""
    if n <= 2 * keep:
        return torch.arange(n)
    return torch.cat((torch.arange(keep), torch.arange(n - keep, n)))


class Expected:
    """A format's float64 reference, act(x W^T + b), and the rounding bound around it, for the rows and
    outputs a check compares; computed once per input and shared by all of the format's paths."""

    def __init__(self, fmt: WeightFormat, w: torch.Tensor, tensors: dict, bias: torch.Tensor,
                 activation: str | None, precision: str):
        self.out_features = w.size(0)
        self.columns = _edges(self.out_features, CHECKED_COLUMNS)
        self.reference = fmt.reference_weight(w, tensors, self.columns)  # (n, K) float64: the checked outputs' rows
        self.bias = bias[self.columns]  # (n,) float64
        self.activation, self.tolerance = activation, TOLERANCE[precision]
        self.reference_abs = self.reference.abs().float()  # for the bound, below
        self.reference_abs_sums = self.reference.abs().sum(1)  # (n,): sum_k |W|
        self.memo = {}

    @staticmethod
    def rows(x: torch.Tensor) -> torch.Tensor:
        return _edges(x.size(0), CHECKED_ROWS)

    def same_as(self, other: "Expected") -> bool:
        return torch.equal(self.reference, other.reference) and self.activation == other.activation

    def __call__(self, x: torch.Tensor, levels: int | None) -> tuple[torch.Tensor, torch.Tensor]:
        """(exact, bound) for x's checked rows and the checked outputs. The bound, per output:
        tol * (|x| @ |W|^T + |b|), plus for activations quantized per token to `levels` levels half a
        quantization step of that row of x (at most [-max|x|, max|x|] over levels - 1 steps: max|x| / 254
        for u8) times sum_k |W|."""
        key = (x.data_ptr(), x.size(0), levels)
        if key not in self.memo:
            xd = x[self.rows(x)].double()
            exact = xd @ self.reference.t() + self.bias
            # A sum of positive terms: float32 holds it to 1e-7 relative, far inside any tolerance, and
            # its GEMM is ~10x float64's.
            bound = self.tolerance * (xd.abs().float() @ self.reference_abs.t() + self.bias.abs().float()).double()
            if levels:  # half a step of each row's x, times sum |W|
                bound = bound + xd.abs().amax(dim=1, keepdim=True) / (levels - 1) * self.reference_abs_sums
            if self.activation is not None:
                exact = torch.nn.functional.gelu(exact, approximate="tanh")  # GELU's slope is within [-0.17, 1.13]
                bound = 1.13 * bound + self.tolerance * exact.abs()
            self.memo[key] = exact, bound
        return self.memo[key]


def _check(path, tensors, b, activation, expected: Expected, x: torch.Tensor,
           levels: int | None) -> tuple[str | None, float]:
    """(None, seconds the call took) if the path computes act(x W^T + b) within its precision's rounding
    for these rows (Expected: the float64 reference and the bound); else (why, seconds)."""
    start = time.perf_counter()
    try:
        y = path(x, path_args(tensors), b, activation)
    except (RuntimeError, NotImplementedError) as e:
        return f"fails at {x.size(0)} rows: {str(e).splitlines()[0][:120]}", 0.0
    elapsed = time.perf_counter() - start
    exact, bound = expected(x, levels)
    if y.shape != (x.size(0), expected.out_features):
        return f"wrong shape {tuple(y.shape)} at {x.size(0)} rows", elapsed
    checked = y[Expected.rows(x)][:, expected.columns].double()
    excess = ((checked - exact).abs() - bound - 1e-6).max().item()
    if not math.isfinite(excess) or excess > 0:
        return f"outside its rounding at {x.size(0)} rows (max excess {excess:.3g})", elapsed
    return None, elapsed


# A regime timed after one with fewer rows, read the same way (both over cold copies, or both over one warm copy)
PRUNED_AFTER = {"batch": "decode", "prefill": "short", "long": "prefill"}


def _may_win(regime: str, times: dict, timings: dict, always: bool = False) -> bool:
    """Whether a path is worth timing at `regime` (a slow path costs up to a second per regime).

    A call's time grows with its rows, and the best path's time at k times the rows is at most k times
    its time (a fixed cost plus a cost per row), so a path more than k times slower than the best at
    the regime before (PRUNED_AFTER, k = the ratio of their rows) cannot be the fastest at this one. A
    path skipped at the regime before is bounded the same way from the last regime it was timed at (a
    path that dequantizes its whole weight per call may lose at 128 rows and win at 512).
    `always` for the first path of each format, so that every format is complete."""
    before = PRUNED_AFTER.get(regime)
    if before is None or always:
        return True
    while before is not None and before not in times:  # skipped there: the bound holds from any regime
        before = PRUNED_AFTER.get(before)              # before it, at its own ratio of rows (long: short's x8)
    if before is None:
        return False
    return times[before] <= ROWS[regime] / ROWS[before] * _best(timings, before) * 1e6


def _best(timings: dict, regime: str) -> float:
    """The fastest time (seconds) measured so far for a regime; inf before the first."""
    return min((t[regime] / 1e6 for paths in timings.values() for t in paths.values() if regime in t),
               default=math.inf)


def _time_in_turn(path, turn: list[tuple], best_so_far: list[float],
                  first_samples: list[float] | None = None, readers: list[tuple] = ()) -> list[float]:
    """Seconds a call of the path takes on each layer of `turn` ((copies, b, activation, x) each, as many
    copies each), called on the layers in turn, one copy of each a round, as a decode step calls a
    block's linears (the one before is another shape's): the fastest of a few repeats of each layer's
    mean, after one warm-up round. first_samples: for a turn of one copy a layer, the time of a call
    just made on each (the check's), which then is both the warm-up and the first sample (a first call
    is the slowest: the minimum is not lowered by it), followed by at least one more: a first call may
    include one-time work, such as oneDNN generating its kernels for a new shape (an int4 "dequant
    bf16" call with GELU at 64 rows took 129 ms the first time and 3.9 ms after).

    The minimum, not the median: other work on the machine only ever adds time, so the fastest repeat
    is the best estimate of the kernel's own cost. Repeats stop early once they take long, after two
    when every layer's are 3x slower than best_so_far, its format's best path so far (it cannot win;
    one sample may be a spike), and after one timed here that took LONG_SAMPLE_S or more: a scheduler
    tick (4-8 ms here) moves such a call by a few percent, and a second sample of each long path costs
    seconds.
    """
    tensors = [[path_args(c) for c in copies] for copies, *_ in turn]
    read = [(reader, [path_args(c) for c in copies], b, activation, x) for reader, copies, b, activation, x in readers]
    rounds = len(tensors[0])

    def sweep() -> list[float]:
        spent = [0.0] * len(turn)
        for i in range(rounds):
            for j, (_, b, activation, x) in enumerate(turn):
                start = time.perf_counter()
                path(x, tensors[j][i], b, activation)
                spent[j] += time.perf_counter() - start
            for reader, copies, b, activation, x in read:  # untimed: the rest of the span
                reader(x, copies[i % len(copies)], b, activation)
        return [s / rounds for s in spent]

    if first_samples is None:
        sweep()  # oneDNN primitive caches, first use of each copy
    samples = [] if first_samples is None else [list(first_samples)]
    spent = 0.0  # in the samples timed here
    while len(samples) < REPEATS and (len(samples) < 2 or spent < 0.05) and spent < LONG_SAMPLE_S:
        samples.append(sweep())
        spent += rounds * sum(samples[-1])
        if len(samples) >= 2 and all(min(s[j] for s in samples) > 3 * best for j, best in enumerate(best_so_far)):
            break
    return [min(s[j] for s in samples) for j in range(len(turn))]


# A format this much slower at decode than the fastest one there is not kept, whatever it gains elsewhere.
# 5%: about the spread of repeated decode timings on a shared VM, so formats that tie at decode are ranked
# by the other regimes instead of by noise.
DECODE_SLACK = 1.05


def _decode_times(timings: dict) -> dict[str, float]:
    """Each format's fastest decode time (formats with no decode path timed are left out)."""
    return {f: min(t["decode"] for t in paths.values() if "decode" in t)
            for f, paths in timings.items() if any("decode" in t for t in paths.values())}


def _fast_at_decode(timings: dict) -> set[str]:
    """The formats whose fastest decode path is within DECODE_SLACK of the fastest of all."""
    decode = _decode_times(timings)
    return {f for f, t in decode.items() if t <= DECODE_SLACK * min(decode.values())}


def _fastest(paths: dict, regime: str) -> str:
    """The path (of path -> regime -> us) fastest at the regime."""
    return min((p for p, t in paths.items() if regime in t), key=lambda p: paths[p][regime])


def _choose(timings: dict, rejected: dict) -> Choice:
    """Decode first: a generated token costs one decode call of every layer, while a prompt's prefill is
    paid once (on an Intel Xeon, float32's 8-row oneDNN layout is 1.6x faster at 8 rows but 1.25x slower
    at 1 row than MKL's). Among the formats within DECODE_SLACK of the fastest decode, the one whose
    regimes are, summed, closest to the best of each (time / best time, over the five regimes) is kept."""
    covering = [f for f in timings if all(any(r in t for t in timings[f].values()) for r in REGIMES)]
    if not covering:
        raise RuntimeError(f"no format has a path for every regime: {timings} {rejected}")
    best = {r: min(t[r] for paths in timings.values() for t in paths.values() if r in t) for r in REGIMES}

    def score(fmt: str) -> float:
        return sum(timings[fmt][_fastest(timings[fmt], r)][r] / best[r] for r in REGIMES)

    fast = _fast_at_decode(timings)
    chosen = min([f for f in covering if f in fast] or covering, key=score)
    return Choice(chosen, {r: _fastest(timings[chosen], r) for r in REGIMES}, timings, rejected)


# A combined format holds one more packed copy of the weight: it is kept where it makes some regime at
# least this much faster than the format chosen alone.
COMBINED_GAIN = 1.25


def _combined_paths(fmt: WeightFormat, timings: dict) -> dict:
    """A combined format's path -> regime -> us, read off its parts' timings (a path two parts have:
    each regime's fastest time of the two)."""
    paths = {}
    for part, names in fmt.parts.items():
        for path, name in names.items():
            for regime, us in timings.get(part, {}).get(path, {}).items():
                paths.setdefault(name, {})[regime] = min(us, paths.get(name, {}).get(regime, math.inf))
    return paths


def _combined_gain(fmt: WeightFormat, choice: Choice) -> tuple[float, str]:
    """(how many times faster, at which regime) the combined format is than the choice's format, at the
    regime where it gains most; it can only gain (the choice's format is one of its parts)."""
    paths, alone = _combined_paths(fmt, choice.timings_us), choice.timings_us[choice.format]
    gains = {r: alone[_fastest(alone, r)][r] / paths[_fastest(paths, r)][r] for r in REGIMES}
    regime = max(gains, key=gains.get)
    return gains[regime], regime


def _choose_combined(choice: Choice, combined: list[WeightFormat]) -> Choice:
    """The choice, or a combined format holding its format and another, where that gains COMBINED_GAIN
    at some regime (each regime then takes the faster path of either)."""
    for fmt in combined:
        paths = _combined_paths(fmt, choice.timings_us)
        covers = all(any(r in t for t in paths.values()) for r in REGIMES)
        if choice.format in fmt.parts and covers and _combined_gain(fmt, choice)[0] >= COMBINED_GAIN:
            return Choice(fmt.name, {r: _fastest(paths, r) for r in REGIMES}, choice.timings_us, choice.rejected)
    return choice


# ---------------------------------------------------------------------------------------------
# the KV cache's dtype (load_for_inference's kv_dtype="auto")
# ---------------------------------------------------------------------------------------------

KV_POSITIONS = 256  # the keys one query attends to when the cache's dtype is timed
KV_ROWS = (1, 8)    # decode and batched decode


def kv_cache_dtype(model, compiled: bool = False) -> tuple[torch.dtype, str]:
    """(the KV caches' dtype for this inference model, why): bf16 where it rounds nothing and its
    attention is no slower here, else float32. compiled: for the caches a compiled decode step reads.

    Where every c_attn returns bf16 (quantize.keys_are_bf16: bfloat16, int8 and int4 plans), a bf16 cache holds
    the very keys and values a float32 one would, in half the bytes. Whether attending over it is faster
    depends on the CPU and on the step: PyTorch's eager bf16 SDPA (one query, 8 x 256 keys) runs 2x faster
    than its float32 one on an Intel Xeon with AMX, and per token 2.5x slower on an AMD EPYC Zen 4, where a
    compiled step's attention over a bf16 cache is 1.6-1.9x faster than over a float32 one (BENCHMARKS.md). So
    each is timed once per machine (attention.json beside the kernel cache)."""
    from gpt2.quantize import keys_are_bf16
    if model.transformer.wte.weight.device.type != "cpu":
        return torch.float32, "measured on CPUs only"
    return kv_dtype_for(keys_are_bf16(model), model.config, compiled)


def kv_dtype_for(keys_bf16: bool, config, compiled: bool = False) -> tuple[torch.dtype, str]:
    """kv_cache_dtype's choice on this CPU, given whether the c_attn's keys are bf16 numbers (for a model,
    quantize.keys_are_bf16; for a plan alone, quantize.plan_keys_are_bf16)."""
    if not keys_bf16:
        return torch.float32, "c_attn returns float32: a bf16 cache would round the keys and values"
    kind = "one-query attention, compiled" if compiled else "one-query attention"
    measure = measure_compiled_kv_dtypes if compiled else measure_kv_dtypes
    key = {"kind": kind, "n_head": config.n_head, "head_size": config.head_size,
           "positions": KV_POSITIONS, "rows": list(KV_ROWS)}
    result, source = cached_measurement("attention", key, lambda: measure(config.n_head, config.head_size),
                                        validate=lambda entry: {d: float(entry[d]) for d in KV_DTYPES})
    faster = result["bfloat16"] <= result["float32"]  # a tie goes to half the memory
    return (torch.bfloat16 if faster else torch.float32,
            f"{source}: {'compiled ' if compiled else ''}attention over a bf16 cache {result['bfloat16']:.1f} us "
            f"a token, float32 {result['float32']:.1f}; the keys are bf16 numbers either way")


def measure_kv_dtypes(n_head: int, head_size: int) -> dict[str, float]:
    """Microseconds a token of eager one-query attention (SDPA, as a decode step runs it) over KV_POSITIONS
    keys, at 1 row plus at 8 rows (per row), for a float32 and a bf16 cache. The caches are copies spanning
    twice the cache this process gets (effective_cache_bytes): a decode step reads them from memory."""
    import torch.nn.functional as F
    return _time_one_query_attention(n_head, head_size, lambda q, k, v: F.scaled_dot_product_attention(q, k, v))


def measure_compiled_kv_dtypes(n_head: int, head_size: int) -> dict[str, float]:
    """measure_kv_dtypes for a compiled decode step: its attention as the step runs it (the model's explicit
    attention under torch.compile, the float32 query over keys and values upcast as they are read, every
    key attended), one graph per cache dtype and row count (~2-5 s to compile them all)."""
    from gpt2.model import CausalSelfAttention, GPTConfig
    attention = CausalSelfAttention(GPTConfig(n_layer=1, n_head=n_head, n_embd=n_head * head_size), 0).eval()
    attend = compiled_one_query_attention()
    masks = {rows: torch.ones(rows, 1, 1, KV_POSITIONS, dtype=torch.bool) for rows in KV_ROWS}  # the keys attended
    return _time_one_query_attention(n_head, head_size, lambda q, k, v: attend(attention, q, k, v, masks[q.size(0)]),
                                     query_dtype=torch.float32)


def _one_query_attention(attention, q, k, v, mask):
    """A compiled decode step's attention (model.CausalSelfAttention under torch.compile): q (B, nh, 1, hs),
    k and v (B, nh, S, hs) in the cache's dtype, upcast to q's as they are read; mask (B, 1, 1, S)."""
    return attention._explicit_attention(q, k.to(q.dtype), v.to(q.dtype), mask)


def compiled_one_query_attention():
    """_one_query_attention under torch.compile, a copy of its code of its own: Dynamo counts the graphs of one
    code object (8 at most), and each measurement compiles 4 (2 dtypes x 2 row counts)."""
    code = _one_query_attention.__code__.replace()
    return torch.compile(types.FunctionType(code, _one_query_attention.__globals__, code.co_name),
                         fullgraph=True, dynamic=False)


def _time_one_query_attention(n_head: int, head_size: int, attend_one, query_dtype=None) -> dict[str, float]:
    """measure_kv_dtypes' timing: attend_one(q, k, v) over cold copies of a float32 and a bf16 cache, the
    query in query_dtype (None: the cache's)."""
    g = torch.Generator().manual_seed(0)
    cost = {}
    for name, dtype in KV_DTYPES.items():  # "float32", "bfloat16"
        cost[name] = 0.0
        for rows in KV_ROWS:
            shape = (rows, n_head, KV_POSITIONS, head_size)
            nbytes = 2 * math.prod(shape) * torch.empty((), dtype=dtype).element_size()
            k, v = torch.randn(shape, generator=g).to(dtype), torch.randn(shape, generator=g).to(dtype)
            # clones (a copy's values do not change its time): drawing 128 MiB of normals costs ~0.1 s
            copies = [(k.clone(), v.clone()) for _ in range(max(2, 2 * effective_cache_bytes() // nbytes))]
            q = torch.randn(rows, n_head, 1, head_size, generator=g).to(query_dtype or dtype)

            def attend():
                for k, v in copies:
                    attend_one(q, k, v)
            with torch.inference_mode():
                attend()  # warm-up: first calls pay for allocations (and a compiled one, its compile)
                seconds = min(_timed(attend) for _ in range(REPEATS)) / len(copies)
            cost[name] += 1e6 * seconds / rows
    return cost

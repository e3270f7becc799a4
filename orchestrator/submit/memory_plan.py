"""Per-GPU memory and communication of each engine for a spec, and a recommendation.

The estimates are pure functions of the model's shape and the setting; both are read
from a spec by ``memory_inputs`` (where an entry-point model is built once, lazily
importing torch and train_entry, to count its parameters).

Model states follow what each engine keeps (bytes per parameter, Ψ = parameters,
N = data-parallel ranks, L = parameters of the largest layer):

- DeepSpeed, mixed precision: 16-bit parameters (2), 16-bit gradients (2), fp32
  gradients (4), fp32 master parameters (4), Adam moments (8); stage 1 partitions
  the last three, stage 2 also the 16-bit gradients, stage 3 everything (its 16-bit
  gradients go straight into the fp32 partition; 4L is the gathered working set of
  the largest layer). This is DeepSpeed's own accounting, so its estimators agree.
- fp32 (any engine): parameters 4, gradients 4, Adam moments 8; no master copy.
- DDP: full replicas (bf16 autocast keeps fp32 weights): 16Ψ.
- FSDP2: fp32 shards of parameters, gradients and Adam moments (16Ψ/N), plus the
  unsharded working parameters and gradients: two units (current and prefetched)
  under `full`, every unit under `shard_grad_op`; `hybrid` shards over one node.

Activations of the built-in model use Korthikanti et al. (2022): per layer
s·b·h·(34 + 5·a·s/h) bytes in 16-bit (an upper bound with fused attention);
with activation checkpointing only each layer's input (s·b·h) stays, plus one
layer recomputed at a time; the logits add s·b·V·(e + 4).

Communication is per rank and optimizer step, ring collectives ((N-1)/N of the
data each way), with G micro-batches per step.

A Hugging Face model (``kind: hf``) is counted from its config on the meta device
(``orchestrator.submit.hf_shape``). Its weights load in ``model.dtype`` (e bytes), and
the states above apply to the T parameters that train, Adam's moments in their dtype:
all of them for a full fine-tune, the adapters under LoRA (fp32, as peft makes them).
The frozen rest costs only its weights: e bytes each, 2 under DeepSpeed's mixed
precision (it casts the whole module), sharded as the engine shards parameters. Under
QLoRA the linear layers but the output head are stored in 4 bits (4.5 bits per weight
with the fp32 block scales, about 4.13 with double quantisation) and the other frozen
weights in fp32 (peft's preparation upcasts them); the 4-bit weights are counted as
replicated on every rank, and FSDP does not apply. Gradients (and their communication)
cover only T; gathers of parameters cover all of them. Activations use the same
formula with the model's layers, width, heads and vocabulary and data.max_length
tokens (an upper bound without packing; an estimate for gated MLPs), without the
attention scores' term under ``attn_implementation: sdpa`` (its kernels never store them).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import NamedTuple

GIB = 1024**3
USABLE = 0.9  # of GPU memory: the rest is the CUDA context, allocator slack, buffers


@dataclass(frozen=True)
class Shape:
    params: int
    largest_layer: int  # the largest single module (DeepSpeed's working set under ZeRO-3)
    unit: int  # parameters of one sharding unit (a transformer block)
    layers: int | None = None
    d_model: int | None = None
    n_head: int | None = None
    seq_len: int | None = None
    vocab: int | None = None
    # what trains and how the weights are stored (the built-in model: all, fp32)
    trainable: int | None = None  # parameters with gradients and optimizer state; None: all
    method: str = "full"  # full | lora | qlora
    weight_bytes: int = 4  # per parameter as loaded (model.dtype)
    trainable_bytes: int = 4  # per trainable parameter (and per Adam moment)
    quantized: int = 0  # frozen weights stored in 4 bits (QLoRA)
    quant_bits: float = 0.0
    activation_bytes: int | None = None  # None: from the precision
    fused_attention: bool = False  # attention scores never stored (SDPA's flash / memory-efficient kernels)
    counted_by: str = "formula"  # how the parameters were counted

    @property
    def train_params(self) -> int:
        return self.params if self.trainable is None else self.trainable

    @property
    def frozen_params(self) -> int:
        """The base under LoRA (``params``; the adapters come on top of it), else none."""
        return self.params if self.method != "full" else self.params - self.train_params

    @property
    def all_params(self) -> int:
        return self.frozen_params + self.train_params

    def frozen_bytes(self, cast_16bit: bool) -> int:
        """Bytes of the weights that do not train (DeepSpeed's mixed precision casts them to 16 bits)."""
        rest = self.frozen_params - self.quantized
        per = 2 if cast_16bit else (4 if self.method == "qlora" else self.weight_bytes)
        return rest * per + int(self.quantized * self.quant_bits / 8)


def gpt_shape(vocab: int, seq_len: int, d: int, layers: int, heads: int) -> Shape:
    """Parameters of the built-in model (train_entry.models.GPT), counted exactly."""
    block = 12 * d * d + 13 * d  # qkv, proj, the MLP's two Linear layers, two LayerNorms
    total = 2 * vocab * d + seq_len * d + layers * block + 2 * d  # embedding, head, positions, final norm
    largest = max(vocab * d, 4 * d * d + 4 * d)
    return Shape(total, largest, block, layers, d, heads, seq_len, vocab)


@dataclass(frozen=True)
class Setting:
    """The hardware and batch the plan is for."""

    nodes: int
    gpus_per_node: int
    gpu_memory: int | None  # bytes per device; None: no recommendation, figures only
    micro_batch: int
    grad_accum: int
    precision: str  # fp32 | bf16 | fp16
    optimizer: str = "adamw"

    @property
    def world(self) -> int:
        return self.nodes * self.gpus_per_node


@dataclass(frozen=True)
class Candidate:
    name: str
    engine: dict  # the spec's `engine:` mapping for it
    offload_level: int = 0  # 0 none, 1 optimizer to CPU, 2 + parameters to CPU, 3 NVMe


CANDIDATES = (
    Candidate("ddp", {"kind": "ddp"}),
    Candidate("zero1", {"kind": "deepspeed", "stage": 1}),
    Candidate("zero2", {"kind": "deepspeed", "stage": 2}),
    Candidate("fsdp-shard-grad-op", {"kind": "fsdp", "sharding": "shard_grad_op"}),
    Candidate("fsdp-hybrid", {"kind": "fsdp", "sharding": "hybrid"}),
    Candidate("fsdp-full", {"kind": "fsdp", "sharding": "full"}),
    Candidate("zero3", {"kind": "deepspeed", "stage": 3}),
    Candidate("fsdp-full-cpu-offload", {"kind": "fsdp", "sharding": "full", "cpu_offload": True}, 2),
    Candidate("zero2-offload-optimizer", {"kind": "deepspeed", "stage": 2, "offload_optimizer": "cpu"}, 1),
    Candidate("zero3-offload-optimizer", {"kind": "deepspeed", "stage": 3, "offload_optimizer": "cpu"}, 1),
    Candidate(
        "zero3-offload-all", {"kind": "deepspeed", "stage": 3, "offload_optimizer": "cpu", "offload_param": "cpu"}, 2
    ),
    Candidate(
        "zero3-nvme", {"kind": "deepspeed", "stage": 3, "offload_optimizer": "nvme", "offload_param": "nvme"}, 3
    ),
)


@dataclass
class Estimate:
    name: str
    engine: dict
    params: int  # bytes per device
    grads: int
    optimizer: int
    working: int  # gathered parameters and gradients of the layers in use
    activations: int | None
    activations_checkpointed: int | None
    offloaded: int  # bytes per device moved to CPU memory (or NVMe)
    comm_bytes: int  # per device per optimizer step
    inter_node_bytes: int
    offload_level: int = 0
    host_load: int = 0  # host memory a rank needs to read the weights (train_entry.hf.weights)
    host_load_shared: bool = False  # the pages of memory-mapped files, shared by the node's ranks

    @property
    def model_states(self) -> int:
        return self.params + self.grads + self.optimizer + self.working

    def peak(self, checkpointing: bool) -> int | None:
        act = self.activations_checkpointed if checkpointing else self.activations
        return None if act is None else self.model_states + act


def _adam_bytes(optimizer: str) -> int:
    return 8 if optimizer == "adamw" else 4  # Adam: two moments; SGD: momentum (upper bound)


def activations(shape: Shape, s: Setting) -> tuple[int | None, int | None]:
    """(without, with activation checkpointing) bytes per device; None for an entry-point model."""
    if shape.layers is None:
        return None, None
    e = shape.activation_bytes or (4 if s.precision == "fp32" and shape.weight_bytes == 4 else 2)
    sbh = shape.seq_len * s.micro_batch * shape.d_model
    scores = 0 if shape.fused_attention else 5 * shape.n_head * shape.seq_len / shape.d_model
    per_layer = int(sbh * (34 + scores) * e / 2)
    logits = shape.seq_len * s.micro_batch * shape.vocab * (e + 4)
    full = shape.layers * per_layer + logits
    checkpointed = shape.layers * sbh * e + per_layer + logits
    return full, checkpointed


def estimate(c: Candidate, shape: Shape, s: Setting) -> Estimate | None:
    """One candidate's figures; None when it does not apply (hybrid on one node, FSDP under QLoRA)."""
    kind = c.engine["kind"]
    if kind == "ddp":
        states = _ddp_states(shape, s)
    elif kind == "fsdp":
        if (c.engine["sharding"] == "hybrid" and s.nodes < 2) or shape.method == "qlora":
            return None
        states = _fsdp_states(c.engine, shape, s)
    else:
        states = _deepspeed_states(c.engine, shape, s)
    if kind != "fsdp" and s.nodes > 1:
        states = states._replace(inter=states.comm)  # flat rings cross node boundaries with all of it
    act, act_ckpt = activations(shape, s)
    return Estimate(c.name, c.engine, states.params, states.grads, states.optim, states.working, act, act_ckpt,
                    states.offloaded, states.comm, states.inter, c.offload_level, *host_load(c.engine, shape, s))


def host_load(engine: dict, shape: Shape, s: Setting) -> tuple[int, bool]:
    """(bytes, shared) of host memory a rank holds while the weights are read: FSDP2 its
    shard plus one tensor's piece; ZeRO-3 its partition plus one module whole (``zero.Init``
    makes each module whole, then splits it); DDP and ZeRO-1/2 the memory-mapped files, whose
    pages the node's ranks share; QLoRA loads whole."""
    wb = shape.weight_bytes
    weights = shape.frozen_bytes(cast_16bit=False) + (shape.train_params * wb if shape.method == "full" else 0)
    if shape.method == "qlora":
        return weights, False
    if engine["kind"] == "fsdp":
        over = s.gpus_per_node if engine["sharding"] == "hybrid" else s.world
        return (weights + shape.largest_layer * wb) // over, False
    if engine["kind"] == "deepspeed" and engine["stage"] == 3:
        return weights // s.world + shape.largest_layer * wb, False
    return weights, True


class _States(NamedTuple):
    """Bytes per device of one engine's model states, and its communication per step."""

    params: int
    grads: int
    optim: int
    working: int
    offloaded: int
    comm: int
    inter: int = 0


def _moments(shape: Shape, s: Setting) -> int:
    """Bytes of optimizer state per trainable parameter: Adam's moments in the trainable parameters' dtype."""
    return _adam_bytes(s.optimizer) * shape.trainable_bytes // 4


def _ring(n: int) -> float:
    """The share of the data each rank sends (and receives) in a ring collective over ``n`` ranks."""
    return (n - 1) / n if n > 1 else 0.0


def _ddp_states(shape: Shape, s: Setting) -> _States:
    T, et = shape.train_params, shape.trainable_bytes
    frozen = shape.frozen_bytes(cast_16bit=False)
    return _States(frozen + et * T, et * T, _moments(shape, s) * T, 0, 0, int(2 * et * T * _ring(s.world)))


def _fsdp_states(engine: dict, shape: Shape, s: Setting) -> _States:
    P, T, G, et = shape.all_params, shape.train_params, s.grad_accum, shape.trainable_bytes
    sharding = engine["sharding"]
    shard_over = s.gpus_per_node if sharding == "hybrid" else s.world
    e_p = 2 if s.precision != "fp32" else shape.weight_bytes
    frozen = shape.frozen_bytes(cast_16bit=False)
    states = ((frozen + et * T) // shard_over, et * T // shard_over, _moments(shape, s) * T // shard_over)
    gathered = P if sharding == "shard_grad_op" else min(P, 2 * shape.unit)
    unit_grads = shape.unit * T // P if P else 0  # a unit's share of what trains
    working = gathered * e_p + 2 * unit_grads * 4  # unsharded params in use + one unit's unsharded grads
    sring = _ring(shard_over)
    gathers = 1 if sharding == "shard_grad_op" else 2
    comm = int(G * gathers * P * e_p * sring + T * 4 * sring)
    inter = 0
    if sharding == "hybrid":
        inter = int(2 * (T // shard_over) * 4 * (s.nodes - 1) / s.nodes)
        comm += inter
    if engine.get("cpu_offload"):
        return _States(0, 0, 0, working, sum(states), comm, inter)
    return _States(*states, working, 0, comm, inter)


def _deepspeed_states(engine: dict, shape: Shape, s: Setting) -> _States:
    P, T, N, G, et = shape.all_params, shape.train_params, s.world, s.grad_accum, shape.trainable_bytes
    mixed = s.precision != "fp32"
    stage = engine["stage"]
    part = lambda nbytes, from_stage: nbytes * T // N if stage >= from_stage else nbytes * T  # noqa: E731
    frozen = shape.frozen_bytes(cast_16bit=mixed)
    if stage >= 3:  # ZeRO-3 partitions every parameter; 4-bit weights are counted whole
        quant = int(shape.quantized * shape.quant_bits / 8)
        frozen = (frozen - quant) // N + quant
    if mixed:
        params = part(2, 3) + frozen
        grads = (0 if stage == 3 else part(2, 2)) + part(4, 1)
        optim = part(4, 1) + part(_adam_bytes(s.optimizer), 1)
    else:
        params, grads, optim = part(et, 3) + frozen, part(et, 2), part(_moments(shape, s), 1)
    working = 4 * shape.largest_layer if stage == 3 else 0
    offloaded = 0
    if engine.get("offload_optimizer", "none") != "none":  # ZeRO-Offload: gradients, master weights, moments
        offloaded, grads, optim = grads + optim, 0, 0
    if engine.get("offload_param", "none") != "none":
        offloaded, params = offloaded + params, 0
    e, ring = (2 if mixed else et), _ring(N)
    per_micro = {0: 0, 1: 0, 2: T * e * ring, 3: (2 * P + T) * e * ring}[stage]
    at_boundary = {0: 2 * T * e * ring, 1: 2 * T * e * ring, 2: T * e * ring, 3: 0}[stage]
    return _States(params, grads, optim, working, offloaded, int(G * per_micro + at_boundary))


@dataclass
class Recommendation:
    name: str | None
    engine: dict | None
    activation_checkpointing: bool
    peak: int | None
    reason: str


def recommend(estimates: list[Estimate], s: Setting, shape: Shape) -> Recommendation:
    """The cheapest setting that fits: no offload before offload, no recomputation
    before recomputation, then the least communication."""
    if s.gpu_memory is None:
        return Recommendation(None, None, False, None, "no GPU memory given (resources.gpu_memory or --gpu-memory)")
    budget = int(s.gpu_memory * USABLE)
    options = []
    order = {c.name: i for i, c in enumerate(CANDIDATES)}  # simplest first, on equal cost
    for est in estimates:
        for ac in (False, True):
            peak = est.peak(ac)
            if peak is None:
                peak = est.model_states  # entry-point model: activations unknown
            options.append(((est.offload_level, ac, est.comm_bytes, order[est.name]), est, ac, peak))
    options.sort(key=lambda o: o[0])
    fits = [o for o in options if o[3] <= budget]
    unknown_act = shape.layers is None
    suffix = " (model states only: activations of an entry-point model are not estimated)" if unknown_act else ""
    if not fits:
        least = min(options, key=lambda o: o[3])
        return Recommendation(
            None,
            None,
            False,
            None,
            f"nothing fits in {human(budget)} usable per GPU ({int(USABLE * 100)} % of {human(s.gpu_memory)}): the least "
            f"is {least[1].name}{' with activation checkpointing' if least[2] else ''} at {human(least[3])}; "
            f"add nodes, or lower batch.micro_batch_size or the sequence length{suffix}",
        )
    _, best, ac, peak = fits[0]
    cheaper = [o for o in options if o[0] < fits[0][0] and not (o[1] is best and o[2] == ac)]
    why = f"{best.name}{' with activation checkpointing' if ac else ''} is the cheapest that fits: {human(peak)} of {human(budget)} usable per GPU"
    if cheaper:
        shown = sorted({(o[1].name + (" +ckpt" if o[2] else ""), o[3]) for o in cheaper}, key=lambda x: x[1])[:3]
        why += "; cheaper ones need " + ", ".join(f"{n} {human(p)}" for n, p in shown)
    return Recommendation(best.name, best.engine, ac, peak, why + suffix)


def plan(shape: Shape, s: Setting) -> dict:
    estimates = [e for c in CANDIDATES if (e := estimate(c, shape, s)) is not None]
    rec = recommend(estimates, s, shape)
    return {
        "setting": asdict(s) | {"world_size": s.world},
        "model": asdict(shape),
        "engines": [
            asdict(e) | {"model_states": e.model_states, "peak": e.peak(False), "peak_checkpointed": e.peak(True)}
            for e in estimates
        ],
        "recommendation": asdict(rec),
    }


def human(n: int | None) -> str:
    if n is None:
        return "?"
    for unit, size in (("GiB", GIB), ("MiB", 1024**2), ("KiB", 1024)):
        if n >= size:
            return f"{n / size:.1f} {unit}"
    return f"{n} B"

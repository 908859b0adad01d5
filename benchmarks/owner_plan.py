#!/usr/bin/env python3
"""Muon's owner plan at 8 to 1024 data-parallel ranks, on paper: Newton-Schulz balance, bytes moved, owner memory.

No GPU and no process group: pure arithmetic on the Muon matrices' shapes. This fork's plan is computed by the
engine's own functions (`flat_layout.owner_layout`, `newton_schulz_cost`, `owner_blocks.ownership_blocks`,
`even_layout`), the ones `DeepSpeedZeroOptimizer` calls at `initialize`, so the table is what the engine would build at
that world size.

Models (only the matrices Muon takes under the default split; embeddings and the head are AdamW's):

* gpt-1.1b: benchmarks/gpt_model.py's GPT at the repo's 1.11B size (20 layers, d_model 2048), built on torch's
  meta device and tagged by `deepspeed.tag_muon_params`.
* llama-7b, llama-70b: Llama 2's published shapes (separate q/k/v/o, gated MLP; 70B with 8 key-value heads).
* moe-30b-a3b: Qwen3-30B-A3B's published shapes (48 layers, d_model 2048, 32 query and 4 key-value heads of 128,
  128 experts of width 768), with the experts fused as transformers stores them: gate_up [128, 1536, 2048] and
  down [128, 2048, 768]; the router [128, 2048] is a Muon matrix under the default split.

Schemes (per rank, per optimizer step, Muon group only; elements move as bf16, 2 bytes):

* owner (this fork): each matrix whole on one owner, balanced by Newton-Schulz cost; a fused expert tensor may be cut
  between consecutive owners at expert boundaries where that lowers the busiest rank's cost (`owner_layout` with the
  engine's block counts); every partition padded to the largest. The reduce-scatter ZeRO does anyway delivers each
  matrix's reduced gradient to its owner and the all-gather publishes the update, so the bytes are ZeRO's
  reduce-scatter + all-gather over the padded partition: 2 (N - 1) P elements sent and as many received.
* owner + split NS (dense models): `owner_layout` also given `split_rows` and `split_repeated_cost`: where whole
  matrices leave the busiest rank above `flat_layout.SPLIT_FROM` (1.1x) an even share, a dense matrix may be cut
  between consecutive ranks at row boundaries, its holders sharing its Newton-Schulz (`executor/split_ns.py`): each
  computes its rows' part of the Gram and of the product with X, and, where the smaller side m is at least
  `ns_split_square.SQUARE_SPLIT_FROM` (2048), its rows of the m x m product, which the holders all-gather; below it
  each repeats the m x m product (m^3 a step). Per step the m x m Gram is all-reduced among them, and a wide matrix
  (rows < cols) is exchanged into column blocks and back (two all-to-alls). Bytes: ZeRO's reduce-scatter + all-gather
  over the padded partition plus those. Compared with: the same with the m x m product repeated on every holder at
  every m ("m x m repeated (before)", what the engine built before); and, for a wide matrix cut by rows, summing its
  n x n Gram instead ("wide by n x n Gram"), on the engine's layout.
* owner, whole tensors (before): the same with every tensor whole on one owner (no cut); MoE only.
* even + gather-to-owner (plan, not in the engine): the Muon group laid out evenly as for AdamW (no owner padding);
  each matrix's owner (the whole-tensor assignment) receives the slices of its reduced gradient that other ranks'
  partitions hold and sends each its slice of the update: ZeRO's bytes plus, per rank, the slices it sends out and
  receives (each once each way).
* round-robin: parameter i on rank i mod N, partitions padded the same way.
* owner per expert: every expert of a fused tensor a separate item of the same assignment (a plan: the engine keeps a
  parameter whole on one owner; docs/performance.md says why); MoE only.
* upstream ZeRO-1/2 (its public description: reduce_scatter is refused with Muon, gradients are all-reduced, and
  every rank whose even partition holds part of a matrix orthogonalises the whole matrix): all-reduce
  2 (N - 1) / N M + all-gather (N - 1) P_even, with the engine's `even_layout` for the partitions.
* Dion Muon (microsoft/dion README: FSDP2 shards every matrix; the step takes same-shape matrices in batches of N,
  one all-to-all unshards each batch so rank j holds matrix j whole, Newton-Schulz there, a second all-to-all
  shards the result back): FSDP's reduce-scatter and all-gather over the even shards plus the two all-to-alls; a
  fused expert tensor counted as E matrices of the batch (the most favourable reading).

"ZeRO RS+AG" is what ZeRO moves for the same elements laid out evenly (AdamW's layout): 2 (N - 1) P_even. Newton-Schulz
TFLOP: 2 flops per multiply-add x 5 iterations x the busiest rank's cost. NS max/mean: the busiest rank's Newton-Schulz
work over the model's (each matrix counted once) divided by N. Idle share: the part of the Newton-Schulz phase the
ranks spend waiting for the busiest, 1 - (mean load) / (max load). Owner memory (a model, not a measurement): the
busiest rank's optimizer-side bytes: its partition's fp32 master and momentum and bf16 reduced gradient (10 bytes an
element) plus the Newton-Schulz workspace of what it orthogonalises at once (6.8 bytes an element in bf16,
docs/muon.md): all its matrices for the owner schemes (one batched call), its largest matrix for Dion, every matrix its
partition touches for upstream (with their fp32 momentum copies, 4 bytes).

    python benchmarks/owner_plan.py [--out benchmarks/results/owner-plan]

Writes owner_plan.json (provenance and every row), owner_plan.md (the tables) and owner_plan.png.
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from gpt_model import GPT, GPT_1_1B, GPTConfig  # noqa: E402
from provenance import provenance  # noqa: E402

import deepspeed  # noqa: E402
from deepspeed.runtime.zero.flat_layout import ALIGNMENT, even_layout, rank_costs  # noqa: E402
from deepspeed.runtime.zero.flat_layout import newton_schulz_cost, owner_layout, split_repeated_cost  # noqa: E402
from deepspeed.runtime.zero.muon.executor.split_ns import column_widths  # noqa: E402
from deepspeed.runtime.zero.muon.math.ns_split_square import splits_square_products  # noqa: E402
from deepspeed.runtime.zero.owner_blocks import ownership_blocks, split_rows  # noqa: E402

RANKS = (8, 64, 256, 1024)
NS_STEPS = 5
ELEMENT_BYTES = 2
STATE_BYTES = 10  # fp32 master + fp32 momentum + bf16 reduced gradient
NS_WORKSPACE_BYTES = 6.8
MOMENTUM_COPY_BYTES = 4
GIB = 2**30

OWNER = "owner (this fork)"
SPLIT = "owner + split NS"
SPLIT_REPEATED = "owner + split NS, m x m repeated (before)"
SPLIT_LARGE_GRAM = "owner + split NS, wide by n x n Gram"
OWNER_WHOLE = "owner, whole tensors (before)"
GATHER = "even + gather-to-owner (plan)"
ROUND_ROBIN = "round-robin"
PER_EXPERT = "owner per expert (plan)"
UPSTREAM = "upstream ZeRO-1/2"
DION = "Dion Muon (FSDP2)"
COLORS = {OWNER: "C0", SPLIT: "C7", SPLIT_REPEATED: "C8", SPLIT_LARGE_GRAM: "C9", OWNER_WHOLE: "C5", GATHER: "C6",
          ROUND_ROBIN: "C1", PER_EXPERT: "C4", UPSTREAM: "C2", DION: "C3"}


def gpt_shapes(config: GPTConfig) -> list[tuple[int, ...]]:
    with torch.device("meta"):
        model = GPT(config)
    deepspeed.tag_muon_params(model)
    return [tuple(p.shape) for p in model.parameters() if p.use_muon]


def llama_shapes(layers: int, d: int, heads: int, kv_heads: int, ffn: int) -> list[tuple[int, ...]]:
    head_dim = d // heads
    block = [(heads * head_dim, d), (kv_heads * head_dim, d), (kv_heads * head_dim, d), (d, heads * head_dim),
             (ffn, d), (ffn, d), (d, ffn)]
    return block * layers


def moe_shapes(layers: int, d: int, heads: int, kv_heads: int, head_dim: int, experts: int,
               expert_ffn: int) -> list[tuple[int, ...]]:
    block = [(heads * head_dim, d), (kv_heads * head_dim, d), (kv_heads * head_dim, d), (d, heads * head_dim),
             (experts, d), (experts, 2 * expert_ffn, d), (experts, d, expert_ffn)]
    return block * layers


MODELS = {
    "gpt-1.1b": lambda: gpt_shapes(GPT_1_1B),
    "llama-7b": lambda: llama_shapes(32, 4096, 32, 32, 11008),
    "llama-70b": lambda: llama_shapes(80, 8192, 64, 8, 28672),
    "moe-30b-a3b": lambda: moe_shapes(48, 2048, 32, 4, 128, 128, 768),
}


def numel(shape) -> int:
    count = 1
    for dim in shape:
        count *= dim
    return count


@dataclass
class Row:
    model: str
    ranks: int
    scheme: str
    ns_max_over_mean: float
    idle_share: float
    ns_max_tflop: float
    sent_gib: float
    received_gib: float
    zero_rs_ag_gib: float
    bytes_over_zero: float
    owner_peak_gib: float
    # Split Newton-Schulz schemes: matrices split, the most ranks sharing one, and the bytes a rank sends for the
    # split (Gram all-reduces, the wide matrices' exchanges) within sent_gib.
    split_matrices: int = 0
    split_holders_max: int = 0
    split_sent_gib: float = 0.0


def _round_up(value: int, multiple: int) -> int:
    return -(-value // multiple) * multiple


def _even_partition(shapes, ranks: int) -> int:
    return even_layout([numel(s) for s in shapes], ranks).partition_size


def _row(model, ranks, scheme, loads, sent, received, peak, zero_bytes, unique_cost=None) -> Row:
    """`unique_cost`: the Newton-Schulz work of the model once (a scheme that repeats work has loads summing to more);
    max / mean compares the busiest rank with that work spread evenly."""
    busiest, mean = max(loads), sum(loads) / ranks
    ideal = (sum(loads) if unique_cost is None else unique_cost) / ranks
    return Row(model, ranks, scheme, busiest / ideal, 1 - mean / busiest, 2 * NS_STEPS * busiest / 1e12, sent / GIB,
               received / GIB, zero_bytes / GIB, max(sent, received) / zero_bytes, peak / GIB)


def owner_scheme(model, shapes, costs, ranks, scheme, owners=None, blocks=None) -> Row:
    """Items on owners: `owners` given (round-robin, each item whole) or the engine's owner_layout (with `blocks`: a
    multi-matrix tensor may be cut between owners at block boundaries, as the engine does)."""
    numels = [numel(s) for s in shapes]
    if owners is None:
        layout = owner_layout(numels, costs, ranks, blocks)
        loads, partition = rank_costs(layout, costs), layout.partition_size
    else:
        held, loads = [0] * ranks, [0] * ranks
        for owner, n, cost in zip(owners, numels, costs):
            held[owner] += n
            loads[owner] += cost
        partition = _round_up(max(held), ALIGNMENT)
    exchanged = 2 * (ranks - 1) * partition * ELEMENT_BYTES
    zero_bytes = 2 * (ranks - 1) * _even_partition(shapes, ranks) * ELEMENT_BYTES
    peak = partition * (STATE_BYTES + NS_WORKSPACE_BYTES)
    return _row(model, ranks, scheme, loads, exchanged, exchanged, peak, zero_bytes)


def split_scheme(model, shapes, costs, ranks, scheme) -> Row:
    """The engine's owner layout with `split_rows`: where whole matrices and blocks leave the busiest rank above
    SPLIT_FROM (1.1) times an even share, dense matrices may be cut at row boundaries between consecutive ranks, which
    share the matrix's Newton-Schulz (`executor/split_ns.py`).

    Per split matrix (m the smaller side, n the larger, k holders, holder j with a share f_j of the rows), per step of
    NS_STEPS: each holder computes its part of the Gram and of the product with X (f_j 2 m^2 n); the m x m Gram is
    all-reduced (ring: 2 (k - 1) / k m^2 elements sent per holder). Where m >= SQUARE_SPLIT_FROM each holder computes
    its rows of the m x m product b A + c A^2 (f_j m^3) and the rows are all-gathered ((k - 1) / k m^2 elements sent
    per holder); below it each holder repeats A^2 (m^3), as `split_repeated_cost` counts it. A wide matrix
    (rows < cols) cut by rows is exchanged into column blocks and back (each holder sends the part of its rows outside
    its own columns, twice). SPLIT_REPEATED: A^2 repeated on every holder at every m, the layout planned so (the
    engine before the m x m products were divided). SPLIT_LARGE_GRAM: the wide matrices' alternative, their n x n Gram
    X_i^T X_i summed instead (f_j 2 m n^2 + n^3 per holder per step, n^2 all-reduced), on the engine's layout."""
    numels = [numel(s) for s in shapes]
    rows = [split_rows(s) for s in shapes]
    before, large_gram = scheme == SPLIT_REPEATED, scheme == SPLIT_LARGE_GRAM
    repeated = [min(s) ** 3 if before else split_repeated_cost(s) for s in shapes]
    layout = owner_layout(numels, costs, ranks, [ownership_blocks(s) for s in shapes], rows, repeated)
    loads = rank_costs(layout, costs, repeated)
    size = layout.partition_size
    extra = [0.0] * ranks
    split, most = 0, 0
    for index, shape in enumerate(shapes):
        if not (layout.shared and layout.shared[index] and layout.is_cut(index)):
            continue
        start, end = layout.param_range(index)
        holders = list(range(start // size, -(-end // size)))
        pieces = [(min(end, (r + 1) * size) - max(start, r * size)) // shape[1] for r in holders]
        k, m, n = len(holders), min(shape), max(shape)
        split, most = split + 1, max(most, k)
        wide = shape[0] < shape[1]
        gram = n * n if wide and large_gram else m * m
        gathered = not before and not (wide and large_gram) and splits_square_products(m)
        widths = column_widths(pieces, shape[1]) if wide and not large_gram else None
        for j, (rank, piece) in enumerate(zip(holders, pieces)):
            extra[rank] += NS_STEPS * (2 + gathered) * (k - 1) / k * gram
            if widths is not None:
                extra[rank] += 2 * piece * (shape[1] - widths[j])
            if wide and large_gram:
                share = piece / shape[0]
                divided = (costs[index] - repeated[index]) * share + repeated[index]
                loads[rank] += share * 2 * m * n * n + n**3 - divided
    zero = 2 * (ranks - 1) * size
    sent = max(zero + e for e in extra)
    zero_bytes = 2 * (ranks - 1) * _even_partition(shapes, ranks) * ELEMENT_BYTES
    peak = size * (STATE_BYTES + NS_WORKSPACE_BYTES)
    row = _row(model, ranks, scheme, loads, sent * ELEMENT_BYTES, sent * ELEMENT_BYTES, peak, zero_bytes,
               unique_cost=sum(costs))
    row.split_matrices, row.split_holders_max, row.split_sent_gib = split, most, max(extra) * ELEMENT_BYTES / GIB
    return row


def per_expert_items(shapes):
    """A fused [E, out, in] tensor as E separate (out, in) matrices; 2-D matrices unchanged."""
    return [item for s in shapes for item in ([s[1:]] * s[0] if len(s) == 3 else [s])]


def upstream_scheme(model, shapes, ranks) -> Row:
    layout = even_layout([numel(s) for s in shapes], ranks)
    costs = [newton_schulz_cost(s) for s in shapes]
    loads, touched = [0] * ranks, [0] * ranks
    for rank in range(ranks):
        for fragment in layout.fragments(rank):
            loads[rank] += costs[fragment.param_index]
            touched[rank] += numel(shapes[fragment.param_index])
    total = sum(numel(s) for s in shapes)
    exchanged = (2 * (ranks - 1) * total / ranks + (ranks - 1) * layout.partition_size) * ELEMENT_BYTES
    zero_bytes = 2 * (ranks - 1) * layout.partition_size * ELEMENT_BYTES
    peak = max(layout.partition_size * STATE_BYTES + t * (NS_WORKSPACE_BYTES + MOMENTUM_COPY_BYTES) for t in touched)
    return _row(model, ranks, UPSTREAM, loads, exchanged, exchanged, peak, zero_bytes, unique_cost=sum(costs))


def dion_scheme(model, shapes, ranks) -> Row:
    matrices = per_expert_items(shapes)
    by_shape: dict = {}
    for shape in matrices:
        by_shape.setdefault(shape, []).append(shape)
    loads, sent, received = [0] * ranks, [0.0] * ranks, [0.0] * ranks
    largest = [0] * ranks
    for shape, same in by_shape.items():
        size, cost = numel(shape), newton_schulz_cost(shape)
        for start in range(0, len(same), ranks):
            count = min(ranks, len(same) - start)
            shard = size / ranks
            for rank in range(ranks):
                holds = rank < count
                # There and back: this rank's shards of the batch's other matrices out, its matrix's shards in.
                sent[rank] += 2 * (count - holds) * shard
                received[rank] += 2 * holds * (ranks - 1) * shard
                if holds:
                    loads[rank] += cost
                    largest[rank] = max(largest[rank], size)
    partition = _even_partition(shapes, ranks)
    fsdp = 2 * (ranks - 1) * partition
    zero_bytes = fsdp * ELEMENT_BYTES
    peak = partition * STATE_BYTES + max(largest) * NS_WORKSPACE_BYTES
    return _row(model, ranks, DION, loads, (fsdp + max(sent)) * ELEMENT_BYTES, (fsdp + max(received)) * ELEMENT_BYTES,
                peak, zero_bytes)


def gather_scheme(model, shapes, costs, ranks) -> Row:
    """A plan: the Muon group laid out evenly (ZeRO's reduce-scatter and all-gather, no owner padding); each matrix
    has an owner (the engine's whole-tensor assignment), which gathers the matrix's reduced gradient from the ranks
    whose even partitions hold it and sends each of them its slice of the orthogonalised update."""
    numels = [numel(s) for s in shapes]
    layout = even_layout(numels, ranks)
    owners = list(owner_layout(numels, costs, ranks).owners)
    loads, moved_in, moved_out, held = [0] * ranks, [0] * ranks, [0] * ranks, [0] * ranks
    for owner, cost, n in zip(owners, costs, numels):
        loads[owner] += cost
        held[owner] += n
    for rank in range(ranks):
        for fragment in layout.fragments(rank):
            owner = owners[fragment.param_index]
            if owner != rank:
                # The gradient slice goes to the owner and the update slice comes back.
                moved_out[rank] += fragment.numel
                moved_in[owner] += fragment.numel
    zero = 2 * (ranks - 1) * layout.partition_size
    sent = max(zero + out + back for out, back in zip(moved_out, moved_in))
    peak = layout.partition_size * STATE_BYTES + max(held) * (NS_WORKSPACE_BYTES + MOMENTUM_COPY_BYTES + 2)
    return _row(model, ranks, GATHER, loads, sent * ELEMENT_BYTES, sent * ELEMENT_BYTES, peak, zero * ELEMENT_BYTES)


def plan(model: str, shapes, ranks: int) -> list[Row]:
    costs = [newton_schulz_cost(s) for s in shapes]
    blocks = [ownership_blocks(s) for s in shapes]
    rows = [owner_scheme(model, shapes, costs, ranks, OWNER, blocks=blocks)]
    fused = any(len(s) == 3 for s in shapes)
    if not fused:
        rows += [split_scheme(model, shapes, costs, ranks, scheme) for scheme in (SPLIT, SPLIT_REPEATED,
                                                                                  SPLIT_LARGE_GRAM)]
    if fused:
        rows.append(owner_scheme(model, shapes, costs, ranks, OWNER_WHOLE))
    rows.append(gather_scheme(model, shapes, costs, ranks))
    rows.append(owner_scheme(model, shapes, costs, ranks, ROUND_ROBIN, owners=[i % ranks for i in range(len(shapes))]))
    if fused:
        items = per_expert_items(shapes)
        rows.append(owner_scheme(model, items, [newton_schulz_cost(s) for s in items], ranks, PER_EXPERT))
    rows.append(upstream_scheme(model, shapes, ranks))
    rows.append(dion_scheme(model, shapes, ranks))
    return rows


COLUMNS = [("ranks", "ranks", "{}"), ("scheme", "scheme", "{}"), ("ns_max_over_mean", "NS max/mean (x)", "{:.3f}"),
           ("idle_share", "idle share of NS (%)", "{:.1f}"), ("ns_max_tflop", "NS TFLOP busiest rank", "{:.3g}"),
           ("sent_gib", "sent GiB/rank", "{:.3g}"), ("received_gib", "received GiB/rank", "{:.3g}"),
           ("zero_rs_ag_gib", "ZeRO RS+AG GiB/rank", "{:.3g}"), ("bytes_over_zero", "bytes / ZeRO (x)", "{:.3f}"),
           ("owner_peak_gib", "owner peak GiB", "{:.3g}"), ("split_matrices", "split matrices", "{}"),
           ("split_holders_max", "most ranks per split", "{}"), ("split_sent_gib", "split GiB/rank", "{:.3g}")]


def densest_tensor(shapes) -> tuple | None:
    """(shape, its Newton-Schulz cost per element over the model's) of the tensor with the most cost per element
    among those the engine may cut between owners at block boundaries, or in a model with none (a dense model) the
    matrices it may split by rows; None when there is none."""
    cuttable = [s for s in shapes if ownership_blocks(s) > 1] or [s for s in shapes if split_rows(s) > 1]
    if not cuttable:
        return None
    mean = sum(newton_schulz_cost(s) for s in shapes) / sum(numel(s) for s in shapes)
    shape = max(cuttable, key=lambda s: newton_schulz_cost(s) / numel(s))
    return shape, newton_schulz_cost(shape) / numel(shape) / mean


def markdown(rows: list[Row], meta: dict, sizes: dict) -> str:
    lines = ["# Muon owner plan at scale", ""]
    lines += [f"- {key}: {value}" for key, value in meta.items()]
    for model, (count, elements, densest) in sizes.items():
        lines += ["", f"## {model}: {count} Muon tensors, {elements:,} elements", ""]
        if densest is not None:
            lines += [f"Costliest tensor that may be cut between ranks, per element: {densest[1]:.2f}x the model's "
                      f"average Newton-Schulz cost per element ({densest[0]}); where it fills whole partitions its "
                      f"ranks do at least that over an even share.", ""]
        lines += ["| " + " | ".join(title for _, title, _ in COLUMNS) + " |", "|" + "---|" * len(COLUMNS)]
        for row in rows:
            if row.model == model:
                values = asdict(row)
                values["idle_share"] *= 100
                cells = [fmt.format(values[key]) for key, _, fmt in COLUMNS]
                lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def figure(rows: list[Row], path: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    models = list(dict.fromkeys(row.model for row in rows))
    fig, axes = plt.subplots(2, len(models), figsize=(4.2 * len(models), 7.5), squeeze=False)
    for column, model in enumerate(models):
        schemes = list(dict.fromkeys(row.scheme for row in rows if row.model == model))
        for scheme in schemes:
            mine = [row for row in rows if row.model == model and row.scheme == scheme]
            ranks = [row.ranks for row in mine]
            axes[0][column].plot(ranks, [row.ns_max_over_mean for row in mine], marker="o", label=scheme,
                                 color=COLORS[scheme])
            axes[1][column].plot(ranks, [row.bytes_over_zero for row in mine], marker="o", label=scheme,
                                 color=COLORS[scheme])
        for axis, title in ((axes[0][column], "Newton-Schulz max / mean"), (axes[1][column], "bytes / ZeRO RS+AG")):
            axis.set_xscale("log", base=2)
            axis.set_yscale("log")
            axis.set_xticks(list(RANKS), [str(r) for r in RANKS])
            axis.axhline(1.1, color="grey", linestyle=":", linewidth=1)
            axis.set_xlabel("data-parallel ranks")
            axis.set_title(f"{model}: {title}", fontsize=9)
            axis.grid(True, which="both", alpha=0.3)
        axes[0][column].legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", default="benchmarks/results/owner-plan")
    args = parser.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    meta = provenance()
    rows, sizes = [], {}
    for model, build in MODELS.items():
        shapes = build()
        sizes[model] = (len(shapes), sum(numel(s) for s in shapes), densest_tensor(shapes))
        for ranks in RANKS:
            rows.extend(plan(model, shapes, ranks))
    (out / "owner_plan.json").write_text(json.dumps({"meta": meta, "models": {
        m: {"tensors": c, "elements": e, "densest_cut_tensor": None if d is None else list(d[0]),
            "densest_cut_cost_per_element_over_mean": None if d is None else d[1]}
        for m, (c, e, d) in sizes.items()},
                                                     "rows": [asdict(row) for row in rows]}, indent=1) + "\n")
    (out / "owner_plan.md").write_text(markdown(rows, meta, sizes))
    figure(rows, out / "owner_plan.png")
    print((out / "owner_plan.md").read_text())


if __name__ == "__main__":
    main()

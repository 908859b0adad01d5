"""Does one rank's Newton-Schulz call get faster with the square matrices' standard iteration on a second stream,
beside the Gram chain of the rectangular ones? Both variants captured in a CUDA graph (as the optimizer replays
it) and timed on the device (CUDA events, median of --reps replays).

    python3 benchmarks/probes/ns_streams_probe.py [--reps 100] [--rank 0]
"""

import argparse
import statistics
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from ns_host_cost import owned_batches  # noqa: E402

from deepspeed.runtime.zero.muon.original_muon import (  # noqa: E402
    _gram_iterations, _normalized_wide, _standard_iterations, zeropower_via_gram_newtonschulz)


def two_streams(batches: list, side: torch.cuda.Stream) -> list:
    prepared = [_normalized_wide(batch, None) for batch in batches]
    squares = [i for i, (X, _) in enumerate(prepared) if X.size(-2) == X.size(-1)]
    others = [i for i in range(len(prepared)) if i not in squares]
    main = torch.cuda.current_stream()
    side.wait_stream(main)
    with torch.cuda.stream(side):
        square_results = [_standard_iterations(prepared[i][0], 5, tall=prepared[i][1]) for i in squares]
    results = _gram_iterations([prepared[i][0] for i in others], 5, tall=[prepared[i][1] for i in others])
    main.wait_stream(side)
    return square_results + results


def replay_ms(call, reps: int) -> tuple:
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(3):
            call()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        outputs = call()
    times = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times), [o.clone() for o in outputs]


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--reps", type=int, default=100)
    parser.add_argument("--rank", type=int, default=0)
    args = parser.parse_args()
    batches = owned_batches(2, args.rank, 12, torch.device("cuda", 0))
    print(f"rank {args.rank}: " + ", ".join(f"{b.size(0)} x {tuple(b.shape[1:])}" for b in batches))
    side = torch.cuda.Stream()
    for label, call in [("one stream", lambda: zeropower_via_gram_newtonschulz(batches)),
                        ("squares on a second stream", lambda: two_streams(batches, side)),
                        ("one stream (again)", lambda: zeropower_via_gram_newtonschulz(batches)),
                        ("squares on a second stream (again)", lambda: two_streams(batches, side))]:
        ms, outputs = replay_ms(call, args.reps)
        print(f"{label:36s} {ms * 1e3:7.1f} us per replay")


if __name__ == "__main__":
    main()

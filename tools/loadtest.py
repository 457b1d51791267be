"""Load test the engine in process, over ZMQ (the engine subprocess), or over
HTTP (a running `kvstrata serve`, or one started here). Same as `kvstrata bench`.

    python tools/loadtest.py --target zmq --workload multi-turn --num-requests 32 --turns 4
    python tools/loadtest.py --target http --url http://127.0.0.1:8000 --workload random --rate 20
    python tools/loadtest.py --target inproc --workload trace --trace arrivals.jsonl --executor null

Workloads: random, shared-prefix, multi-turn, sharegpt (needs `pip install
'kvstrata[bench]'`), trace (JSONL with arrival times). Arrivals: Poisson with
--rate, else paced by --concurrency. Prints the JSON report (throughput,
TTFT/TPOT/ITL/E2E p50/p90/p99, prefix hit rate per tier, preemptions);
--output FILE also writes it, --plot-dir DIR adds PNG plots when matplotlib
is installed. Engine config flags as in `kvstrata bench --help`.
"""

import sys

from kvstrata.cli import main

if __name__ == "__main__":
    sys.exit(main(["bench", *sys.argv[1:]]))

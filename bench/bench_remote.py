"""Reading a cache on object storage: DatasetRT over a local S3 server (moto), epoch by epoch.

The same samples are written as a DatasetRT cache, published on moto's S3 server with
``dataset-rt push``, and read shuffled in place (``open_caches`` on the ``s3://`` URL) for two
epochs with a local cache budget of a share of the dataset (``--budget``, 25% by default) and with
a budget that holds all of it. Every request goes through a counting proxy in front of the
server, which can also add a latency per request (``--latency-ms``) to stand for a remote store.

Reported per payload size and budget: samples/s of each epoch, beside the same epoch read from a
local copy (warm, in process) in the same run; the requests and bytes the server answered in each
epoch (bytes as a multiple of the dataset); and whether the epoch is the exact global permutation
the local copy gives (compared sample by sample).

    python bench/bench_remote.py                       # 4 KiB and 128 KiB, 256 MiB each
    python bench/bench_remote.py --mib 64 --latency-ms 0

The peers read the same payloads from the same server, with the same budget: MosaicML
Streaming's MDS (``StreamingDataset(remote=..., cache_limit=...)``) and LitData's ``optimize()``
output (``StreamingDataset(..., max_cache_size=...)``), both in 64 MB shards or chunks, shuffled,
iterated in process. Both are written locally by ``bench/peers.py`` and uploaded as they are.
Every epoch is checked to hold each sample once. Neither peer shuffles globally (both shuffle
shards or chunks, then samples within a window); DatasetRT's epochs are compared sample by
sample with the local copy's global shuffle.
"""

from __future__ import annotations

import argparse
import contextlib
import http.client
import http.server
import logging
import os
import shutil
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from common import (
    DATA_DIR,
    MIB,
    SIZES,
    fmt,
    import_dataset_rt,
    machine_info,
    markdown_table,
    num_samples,
    payload_buffer,
    reset_dir,
    write_results,
)

BUCKET = "bench"
COUNTS_PATH = "/__bench_counts__"
ACCESS_KEY = "AKIABENCHREMOTE00001"
SECRET_KEY = "bench-remote-secret"


class Counter:
    """Requests and body bytes the proxy answered (in the server process)."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.requests = 0
        self.bytes = 0

    def take(self) -> tuple[int, int]:
        with self.lock:
            out = (self.requests, self.bytes)
            self.requests = self.bytes = 0
            return out


class RemoteCounter:
    """The proxy's counts, read (and reset) from the benchmark's process."""

    def __init__(self, endpoint: str) -> None:
        self.host, self.port = endpoint.removeprefix("http://").split(":")

    def take(self) -> tuple[int, int]:
        conn = http.client.HTTPConnection(self.host, int(self.port), timeout=10)
        conn.request("GET", COUNTS_PATH)
        requests, fetched = conn.getresponse().read().decode().split()
        conn.close()
        return int(requests), int(fetched)


def start_proxy(target: tuple[str, int], latency: float, counter: Counter) -> Any:
    """A threaded HTTP proxy to ``target`` that counts requests and body bytes served, and waits
    ``latency`` seconds before answering each request."""

    class Handler(http.server.BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def log_message(self, *args: Any) -> None:
            pass

        def forward(self) -> None:
            if self.path == COUNTS_PATH:
                text = "{} {}".format(*counter.take()).encode()
                self.send_response(200)
                self.send_header("Content-Length", str(len(text)))
                self.end_headers()
                self.wfile.write(text)
                return
            length = int(self.headers.get("Content-Length") or 0)
            body = self.rfile.read(length) if length else None
            if latency:
                time.sleep(latency)
            conn = http.client.HTTPConnection(*target, timeout=60)
            headers = {k: v for k, v in self.headers.items() if k.lower() != "connection"}
            conn.request(self.command, self.path, body=body, headers=headers)
            response = conn.getresponse()
            data = response.read()
            conn.close()
            with counter.lock:
                counter.requests += 1
                counter.bytes += len(data)
            self.send_response(response.status)
            for k, v in response.getheaders():
                if k.lower() not in ("transfer-encoding", "connection", "content-length"):
                    self.send_header(k, v)
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            if self.command != "HEAD":
                self.wfile.write(data)

        do_GET = do_PUT = do_POST = do_HEAD = do_DELETE = forward

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    server.daemon_threads = True
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return server


def serve(latency: float) -> None:
    """The server process: moto's S3 server behind the counting proxy, until killed. Prints
    the proxy's endpoint on its first line."""
    from moto.server import ThreadedMotoServer

    logging.getLogger("werkzeug").setLevel(logging.ERROR)
    moto = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    moto.start()
    proxy = start_proxy(moto.get_host_and_port(), latency, Counter())
    print(f"http://127.0.0.1:{proxy.server_address[1]}", flush=True)
    threading.Event().wait()


@contextlib.contextmanager
def s3_server(latency: float) -> Iterator[str]:
    """Starts the server process (so that it does not share this process's GIL), points the AWS
    environment at it and creates the bucket; stops it after."""
    process = subprocess.Popen(
        [sys.executable, __file__, "--serve", str(latency)],
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert process.stdout is not None
        endpoint = process.stdout.readline().strip()
        os.environ.update(
            AWS_ACCESS_KEY_ID=ACCESS_KEY,
            AWS_SECRET_ACCESS_KEY=SECRET_KEY,
            AWS_REGION="us-east-1",
            AWS_ENDPOINT_URL=endpoint,
            AWS_ALLOW_HTTP="true",
        )
        import boto3

        boto3.client("s3", endpoint_url=endpoint, region_name="us-east-1").create_bucket(
            Bucket=BUCKET
        )
        yield endpoint
    finally:
        process.kill()
        process.wait()


def write_local(drt: Any, base: Path, name: str, count: int, size: int) -> Path:
    buf = payload_buffer(count, size)

    class Source:
        def __init__(self) -> None:
            self.name = name

        def __iter__(self) -> Iterator[Any]:
            for i in range(count):
                yield drt.CacheInput(
                    data=buf[i * size : (i + 1) * size].tobytes(), metadata={"i": i}
                )

    with drt.DatasetRuntime(num_workers=2) as runtime:
        result = runtime.from_cache_sources(
            Source(),
            base,
            writer_config=drt.WriterConfig(show_progress=False, shard_size_bytes=8 * MIB),
        )
    assert isinstance(result, drt.CacheSourcesDatasetSuccess), result
    return base / name


def upload(local: Path, prefix: str) -> None:
    """Every file under ``local`` to ``s3://BUCKET/prefix/...`` (the peers' stores)."""
    import boto3

    client = boto3.client("s3")
    for path in sorted(local.rglob("*")):
        if path.is_file():
            client.upload_file(str(path), BUCKET, f"{prefix}/{path.relative_to(local)}")


def read_peer(items: Iterator[Any], index: dict[int, int]) -> tuple[float, list[int]]:
    start = time.perf_counter()
    ids = [index.get(hash(bytes(item["data"])), -1) for item in items]
    return time.perf_counter() - start, ids


def open_peer(name: str, url: str, cache: Path, budget: int) -> Any:
    if name == "streaming":
        from streaming import StreamingDataset

        os.environ["S3_ENDPOINT_URL"] = os.environ["AWS_ENDPOINT_URL"]
        return StreamingDataset(
            remote=url,
            local=str(cache),
            shuffle=True,
            shuffle_seed=1,
            batch_size=1,
            cache_limit=budget,
        )
    import litdata
    import litdata.streaming.downloader as downloader

    # Its object_store client takes no plain-HTTP permission from the environment.
    downloader._OBSTORE_CLIENT_OPTIONS["allow_http"] = "true"
    return litdata.StreamingDataset(
        url, shuffle=True, seed=1, cache_dir=str(cache), max_cache_size=f"{budget // MIB}MB"
    )


def peer_rows(
    label: str,
    size: int,
    count: int,
    budget: int,
    work: Path,
    counter: RemoteCounter,
    epochs: int,
) -> list[dict[str, Any]]:
    """Streaming and LitData over the same server and budget: samples/s, requests and bytes per
    epoch, and whether each epoch held every sample once."""
    import peers

    buf = payload_buffer(count, size)
    index = {hash(buf[i * size : (i + 1) * size].tobytes()): i for i in range(count)}
    flat = work / f"flat-{label}.bin"
    buf.tofile(flat)
    payloads = [buf[i * size : (i + 1) * size] for i in range(count)]
    writers = {
        "streaming": lambda out: peers.write_mds(out, payloads),
        "litdata": lambda out: peers.write_litdata(
            out, flat, [(i * size, size) for i in range(count)]
        ),
    }
    rows = []
    for name, write in writers.items():
        out = work / f"{name}-{label}"
        try:
            write(out)
            upload(out, f"{label}/{name}")
        except Exception as error:  # a peer that is missing or fails is reported, not fatal
            print(f"# {name}: not measured ({type(error).__name__}: {error})", file=sys.stderr)
            continue
        cache = reset_dir(work / f"{name}-cache-{label}")
        counter.take()
        # Streaming refuses a cache smaller than four of its largest shards: it gets that.
        shard = max(p.stat().st_size for p in out.rglob("*") if p.is_file())
        limit = max(budget, 4 * shard + MIB) if name == "streaming" else budget
        try:
            dataset = open_peer(name, f"s3://{BUCKET}/{label}/{name}", cache, limit)
            for epoch in range(epochs):
                if hasattr(dataset, "set_epoch"):
                    dataset.set_epoch(epoch)
                seconds, ids = read_peer(iter(dataset), index)
                requests, fetched = counter.take()
                rows.append(
                    {
                        "reader": name,
                        "size": label,
                        "budget_bytes": limit,
                        "epoch": epoch,
                        "samples": count,
                        "samples_per_s": len(ids) / seconds,
                        "requests": requests,
                        "bytes": fetched,
                        "bytes_vs_dataset": fetched / (count * size),
                        "each_sample_once": sorted(ids) == list(range(count)),
                        "global_shuffle": False,
                    }
                )
        except Exception as error:
            print(f"# {name}: reading failed ({type(error).__name__}: {error})", file=sys.stderr)
        shutil.rmtree(cache, ignore_errors=True)
    flat.unlink()
    return rows


def read_epoch(dataset: Any, epoch: int) -> tuple[float, list[int]]:
    dataset.set_epoch(epoch)
    start = time.perf_counter()
    ids = [s.metadata["i"] for s in dataset]
    return time.perf_counter() - start, ids


def run_size(
    drt: Any, label: str, size: int, args: argparse.Namespace, counter: Counter, work: Path
) -> list[dict[str, Any]]:
    count = num_samples(size, args.mib * MIB)
    dataset_bytes = count * size
    local = write_local(drt, reset_dir(work / label), "train", count, size)
    url = f"s3://{BUCKET}/{label}"
    drt._native.push_cache(local, f"{url}/train", drt.RemoteConfig())
    # A budget is a share of the cache as it is stored (headers and alignment included), so
    # that a share of 1.0 holds all of it.
    cache_bytes = sum(p.stat().st_size for p in local.rglob("*") if p.is_file())
    counter.take()
    rows = []
    with drt.DatasetRuntime(num_workers=2) as runtime:
        config = drt.ReaderConfig(seed=1, verify="once")
        local_ds = runtime.open_caches("train", local.parent, reader_config=config).dataset
        local_epochs = [read_epoch(local_ds, e) for e in range(args.epochs)]
        local_epochs = [read_epoch(local_ds, e) for e in range(args.epochs)]  # warm
        for budget_share in (args.budget, 1.0):
            node = reset_dir(work / f"node-{label}")
            budget = max(64 * MIB, int(cache_bytes * budget_share))
            remote = drt.RemoteConfig(
                local_dir=node, max_local_bytes=budget, max_requests=args.max_requests
            )
            counter.take()
            result = runtime.open_caches("train", url, reader_config=config, remote=remote)
            assert isinstance(result, drt.CacheSourcesDatasetSuccess), result
            open_requests, open_bytes = counter.take()
            for epoch in range(args.epochs):
                seconds, ids = read_epoch(result.dataset, epoch)
                requests, fetched = counter.take()
                local_seconds, local_ids = local_epochs[epoch]
                rows.append(
                    {
                        "reader": "dataset_rt",
                        "size": label,
                        "budget": budget_share,
                        "budget_bytes": budget,
                        "epoch": epoch,
                        "samples": count,
                        "samples_per_s": count / seconds,
                        "local_samples_per_s": count / local_seconds,
                        "requests": requests + (open_requests if epoch == 0 else 0),
                        "bytes": fetched + (open_bytes if epoch == 0 else 0),
                        "bytes_vs_dataset": (fetched + (open_bytes if epoch == 0 else 0))
                        / dataset_bytes,
                        "each_sample_once": sorted(ids) == list(range(count)),
                        "global_shuffle": ids == local_ids,
                    }
                )
            del result
            shutil.rmtree(node, ignore_errors=True)
    if not args.no_peers:
        budget = max(64 * MIB, int(cache_bytes * args.budget))
        rows += peer_rows(label, size, count, budget, work, counter, args.epochs)
    return rows


def _size(n: int) -> str:
    return f"{n / MIB:.0f} MiB"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", nargs="+", default=list(SIZES), choices=list(SIZES))
    parser.add_argument("--mib", type=int, default=256, help="dataset size per payload size")
    parser.add_argument("--budget", type=float, default=0.25, help="local budget, a share")
    parser.add_argument("--epochs", type=int, default=2)
    parser.add_argument("--latency-ms", type=float, default=20.0)
    parser.add_argument("--max-requests", type=int, default=64)
    parser.add_argument("--no-peers", action="store_true", help="DatasetRT only")
    args = parser.parse_args()
    drt = import_dataset_rt()
    work = DATA_DIR / "remote"
    rows: list[dict[str, Any]] = []
    with s3_server(args.latency_ms / 1000) as endpoint:
        counter = RemoteCounter(endpoint)
        for label in args.sizes:
            rows += run_size(drt, label, SIZES[label], args, counter, work)
    table = [
        [
            r["reader"],
            r["size"],
            _size(r["budget_bytes"]),
            r["epoch"],
            fmt(r["samples_per_s"]),
            r["requests"],
            fmt(r["bytes_vs_dataset"]),
            "yes" if r["each_sample_once"] else "NO",
            "yes" if r["global_shuffle"] else "no",
        ]
        for r in rows
    ]
    headers = ["reader", "size", "budget", "epoch", "samples/s", "requests", "bytes / dataset"]
    print(markdown_table([*headers, "each sample once", "global shuffle"], table))
    first = {
        (r["reader"], r["size"], r["budget_bytes"]): r["samples_per_s"]
        for r in rows
        if r["epoch"] == 0
    }
    for (reader, label, budget), rate in sorted(first.items()):
        ours = first.get(("dataset_rt", label, budget))
        if reader != "dataset_rt" and ours:
            print(
                f"{label}, budget {_size(budget)}: DatasetRT's first epoch "
                f"{ours / rate:.2f}x {reader}'s"
            )
    path = write_results("remote", {"machine": machine_info(), "args": vars(args), "rows": rows})
    print(f"results: {path}", file=sys.stderr)


if __name__ == "__main__":
    if sys.argv[1:2] == ["--serve"]:
        serve(float(sys.argv[2]))
    else:
        main()

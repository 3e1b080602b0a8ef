"""hybridserve vs vLLM's CPU build, side by side on this machine, one server at a time.

For each server: start it in its own process group, wait for /health, send one warm-up request, then run the
neutral load generator (../shared/bench/loadgen.py) once per concurrency level while sampling the summed RSS
of the server's process tree every 0.2 s. Writes <out>/serving_<stamp>.csv and .png, one log per server, and
prints a markdown table on stdout (progress goes to stderr).

  .venv/bin/python benchmarks/serving_compare.py                      # both servers, conc 1,8,32,64
  .venv/bin/python benchmarks/serving_compare.py --servers hybridserve --conc 1,8 --max-tokens 32

Against an earlier hybridserve (a refactoring must not cost speed): check the earlier commit out beside this one
and name it as the baseline; it runs on this checkout's virtual environment.

  git worktree add ../hybridserve-base <commit>
  .venv/bin/python benchmarks/serving_compare.py --servers hybridserve,baseline --baseline ../hybridserve-base

On a noisy machine whichever server runs first can win by the minute's luck: `--rounds N` runs the servers N
times, in reverse order every other round, and the table and plot show each level's median over the rounds
(peak RSS: the largest; the CSV keeps every round's rows).
"""

from __future__ import annotations

import argparse
import csv
import json
import os
import shlex
import signal
import socket
import statistics
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from contextlib import contextmanager, suppress
from dataclasses import astuple, dataclass, fields, replace
from pathlib import Path

from peers import MODEL, same_dtype_as_engine, vllm_command, vllm_env, vllm_missing

REPO = Path(__file__).resolve().parents[1]
SERVERS = ("hybridserve", "baseline", "vllm")
TITLES = {"hybridserve": "hybridserve", "baseline": "hybridserve (baseline)", "vllm": "vLLM (CPU)"}
SAMPLE_EVERY_S = 0.2
PROGRESS_EVERY_S = 15.0
STOP_GRACE_S = 30.0


class ServerFailed(RuntimeError):
    """A server died, never became healthy, or failed its warm-up; the message carries its log tail."""


@dataclass(frozen=True)
class Row:
    server: str
    conc: int
    requests: int
    errors: int
    output_tok_s: float | None
    ttft_p50_ms: float | None
    ttft_p99_ms: float | None
    itl_p50_ms: float | None
    peak_rss_mib: float
    round: int = 0


def say(message: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {message}", file=sys.stderr, flush=True)


def log_tail(path: Path, lines: int = 40) -> str:
    text = path.read_text(errors="replace").splitlines() if path.exists() else ["(no log written)"]
    return "\n".join(f"    | {line}" for line in text[-lines:])


# ---- memory: summed RSS of a process and all its descendants ----------------------------------------------


def _tree_rss_psutil(pid: int) -> int:
    import psutil

    try:
        root = psutil.Process(pid)
        procs = [root, *root.children(recursive=True)]
    except psutil.NoSuchProcess:
        return 0
    total = 0
    for proc in procs:
        with suppress(psutil.NoSuchProcess, psutil.AccessDenied):  # exited between listing and reading
            total += proc.memory_info().rss
    return total


def _tree_rss_proc(pid: int) -> int:
    children: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                ppid = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
            children.setdefault(ppid, []).append(int(entry.name))
    total, todo = 0, [pid]
    while todo:
        current = todo.pop()
        todo.extend(children.get(current, []))
        try:
            status = Path(f"/proc/{current}/status").read_text()
        except OSError:
            continue
        for line in status.splitlines():
            if line.startswith("VmRSS:"):
                total += int(line.split()[1]) * 1024
    return total


try:
    import psutil  # noqa: F401

    tree_rss_bytes = _tree_rss_psutil
except ImportError:
    tree_rss_bytes = _tree_rss_proc


class PeakRss:
    """Samples tree_rss_bytes(pid) on a thread every SAMPLE_EVERY_S while the `with` block runs."""

    def __init__(self, pid: int) -> None:
        self.pid = pid
        self.peak = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while True:
            self.peak = max(self.peak, tree_rss_bytes(self.pid))
            if self._stop.wait(SAMPLE_EVERY_S):
                return

    def __enter__(self) -> PeakRss:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()
        self.peak = max(self.peak, tree_rss_bytes(self.pid))


# ---- server lifecycle ---------------------------------------------------------------------------------------


def server_command(name: str, args: argparse.Namespace) -> tuple[list[str], dict[str, str]]:
    env = dict(os.environ)
    if name in ("hybridserve", "baseline"):
        if name == "baseline":  # the earlier tree's package shadows this checkout's editable install
            env["PYTHONPATH"] = str(args.baseline.resolve())
            env["PYTHONSAFEPATH"] = "1"  # else `-m` puts the working directory, this checkout, first on the path
        exe = [str(REPO / ".venv" / "bin" / "python"), "-m", "hybridserve.serving.cli"]
        return [*exe, "serve", "--port", str(args.port), *shlex.split(args.hybridserve_args)], env
    server = vllm_command(args.peer_root, "vllm.entrypoints.openai.api_server", args.vllm_dtype)
    address = ["--host", "127.0.0.1", "--port", str(args.port)]
    return [*server, *address, *shlex.split(args.vllm_args)], vllm_env(args.peer_root)


def port_open(port: int) -> bool:
    with socket.socket() as sock:
        sock.settimeout(0.5)
        return sock.connect_ex(("127.0.0.1", port)) == 0


def http_get_ok(url: str) -> bool:
    try:
        with urllib.request.urlopen(url, timeout=5) as response:
            return response.status == 200
    except (urllib.error.URLError, OSError):
        return False


def wait_healthy(name: str, proc: subprocess.Popen[bytes], url: str, log: Path, timeout_s: float) -> None:
    start = last_report = time.monotonic()
    while not http_get_ok(url + "/health"):
        now = time.monotonic()
        if proc.poll() is not None:
            raise ServerFailed(f"{name} exited with code {proc.returncode} during start-up; {log}:\n{log_tail(log)}")
        if now - start > timeout_s:
            raise ServerFailed(f"{name} not healthy after {timeout_s:.0f} s; {log}:\n{log_tail(log)}")
        if now - last_report >= PROGRESS_EVERY_S:
            say(f"{name}: waiting for /health, {now - start:.0f} s so far (log: {log})")
            last_report = now
        time.sleep(1.0)
    say(f"{name}: healthy after {time.monotonic() - start:.0f} s")


def warm_up(name: str, url: str, log: Path) -> None:
    body = {"model": MODEL, "max_tokens": 16, "messages": [{"role": "user", "content": "Say hello."}]}
    request = urllib.request.Request(
        url + "/v1/chat/completions", data=json.dumps(body).encode(), headers={"Content-Type": "application/json"}
    )
    start = time.monotonic()
    try:
        with urllib.request.urlopen(request, timeout=600) as response:
            json.load(response)
    except (urllib.error.URLError, OSError, ValueError) as exc:
        raise ServerFailed(f"{name} failed its warm-up request: {exc!r}; {log}:\n{log_tail(log)}") from exc
    say(f"{name}: warm-up request took {time.monotonic() - start:.1f} s")


def group_alive(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return False
    return True


def stop_server(name: str, proc: subprocess.Popen[bytes]) -> None:
    """SIGTERM the server's process group, then SIGKILL whatever is left of it after STOP_GRACE_S."""
    try:
        import psutil

        tree = [psutil.Process(proc.pid), *psutil.Process(proc.pid).children(recursive=True)]
    except Exception:  # psutil missing or the server already gone: the process group still covers it
        tree = []
    for sig, grace in ((signal.SIGTERM, STOP_GRACE_S), (signal.SIGKILL, 10.0)):
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            break
        deadline = time.monotonic() + grace
        while time.monotonic() < deadline:
            proc.poll()  # reaps the leader, whose zombie would keep the group alive
            if not group_alive(proc.pid):
                break
            time.sleep(0.2)
        else:
            say(f"{name}: process group still running {grace:.0f} s after {sig.name}")
            continue
        break
    for leftover in tree:  # descendants that left the group (setsid) still go
        with suppress(Exception):
            if leftover.is_running():
                leftover.kill()
    proc.wait()
    say(f"{name}: stopped")


def warn_if_busy(name: str) -> None:
    """Other work on the machine skews every number; say so before the server starts."""
    try:
        import psutil
    except ImportError:
        return
    busy = psutil.cpu_percent(interval=1.0)
    if busy > 25:
        say(f"{name}: WARNING: the machine is {busy:.0f}% busy before start; results will be noisy")


def imported_from(command: list[str], env: dict[str, str]) -> Path:
    """Where `command`'s interpreter, in `env`, imports hybridserve from."""
    probe = [command[0], "-c", "import hybridserve; print(hybridserve.__file__)"]
    done = subprocess.run(probe, env=env, capture_output=True, text=True, check=True, timeout=120)
    return Path(done.stdout.strip()).resolve().parents[1]


@contextmanager
def running_server(name: str, args: argparse.Namespace, log: Path) -> Iterator[subprocess.Popen[bytes]]:
    if name == "vllm" and (why := vllm_missing(args.peer_root, args.bench_dir)) is not None:
        raise ServerFailed(why)
    command, env = server_command(name, args)
    if name == "baseline" and (tree := imported_from(command, env)) != args.baseline.resolve():
        raise ServerFailed(f"baseline would import hybridserve from {tree}, not from --baseline {args.baseline}")
    warn_if_busy(name)
    with started(name, command, env, args, log) as proc:
        yield proc


@contextmanager
def hybridserve_with(name: str, flags: list[str], args: argparse.Namespace, log: Path) -> Iterator[str]:
    """`hybridserve serve` with these flags and `args.server_args` on `args.port`, healthy and warmed up: its URL."""
    command = [
        str(REPO / ".venv" / "bin" / "python"),
        "-m",
        "hybridserve.serving.cli",
        "serve",
        "--port",
        str(args.port),
        *flags,
        *shlex.split(args.server_args),
    ]
    with started(name, command, None, args, log):
        yield f"http://127.0.0.1:{args.port}"


@contextmanager
def started(
    name: str, command: list[str], env: dict[str, str] | None, args: argparse.Namespace, log: Path
) -> Iterator[subprocess.Popen[bytes]]:
    """Runs `command` (a server on `args.port`) until the block ends, once it is healthy and warmed up."""
    if port_open(args.port):
        raise ServerFailed(f"port {args.port} is already in use; stop that server or pick another with --port")
    say(f"{name}: starting `{shlex.join(command)}` on port {args.port}, log {log}")
    with log.open("wb") as sink:
        proc = subprocess.Popen(command, env=env, stdout=sink, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        url = f"http://127.0.0.1:{args.port}"
        wait_healthy(name, proc, url, log, args.startup_timeout)
        warm_up(name, url, log)
        yield proc
    finally:
        stop_server(name, proc)


# ---- load ---------------------------------------------------------------------------------------------------


def run_level(name: str, conc: int, proc: subprocess.Popen[bytes], args: argparse.Namespace, log: Path) -> Row:
    command = [
        sys.executable, str(args.bench_dir / "loadgen.py"), "--url", f"http://127.0.0.1:{args.port}",
        "--model", MODEL, "--conc", str(conc), "--max-tokens", str(args.max_tokens), "--waves", str(args.waves),
        "--prompt", args.prompt, "--label", name, "--run-tag", args.stamp,
    ]  # fmt: skip
    with PeakRss(proc.pid) as rss:
        done = subprocess.run(command, capture_output=True, text=True, check=False)
    if proc.poll() is not None:
        raise ServerFailed(f"{name} died during conc {conc} (code {proc.returncode}); {log}:\n{log_tail(log)}")
    lines = [json.loads(line) for line in done.stdout.splitlines() if line.startswith("{")]
    if done.returncode != 0 or len(lines) != 1:
        raise RuntimeError(f"loadgen failed (rc {done.returncode}) at conc {conc}:\n{done.stderr[-2000:]}")
    result = lines[0]
    row = Row(
        server=name,
        conc=conc,
        requests=result["requests"],
        errors=result["errors"],
        output_tok_s=result.get("output_tok_s"),
        ttft_p50_ms=result.get("ttft_p50_ms"),
        ttft_p99_ms=result.get("ttft_p99_ms"),
        itl_p50_ms=result.get("itl_p50_ms"),
        peak_rss_mib=round(rss.peak / 2**20, 1),
    )
    say(
        f"{name} conc {conc}: {row.output_tok_s} tok/s, TTFT p50 {row.ttft_p50_ms} ms, ITL p50 {row.itl_p50_ms} ms, "
        f"peak RSS {row.peak_rss_mib} MiB, {row.errors}/{row.requests} errors, wall {result['wall_s']} s"
    )
    if result.get("first_error"):
        say(f"{name} conc {conc}: first error: {result['first_error']}")
    if result.get("min_tokens", args.max_tokens) < args.max_tokens:
        say(f"{name} conc {conc}: some requests stopped at {result['min_tokens']} tokens (ignore_eos not honoured?)")
    return row


def bench_server(name: str, args: argparse.Namespace, rows: list[Row], round_: int) -> None:
    """Appends one row per level as it is measured, so a later failure keeps the levels already done."""
    log = args.out / f"{name}_{args.stamp}_r{round_}.log"
    with running_server(name, args, log) as proc:
        for conc in args.conc:
            say(f"{name}: round {round_}, conc {conc}, {conc * args.waves} requests of {args.max_tokens} tokens")
            rows.append(replace(run_level(name, conc, proc, args, log), round=round_))


def _median(values: list[float | None]) -> float | None:
    known = [v for v in values if v is not None]
    return round(statistics.median(known), 2) if known else None


def summarise(rows: list[Row]) -> list[Row]:
    """One row per server and level over its rounds: medians of the rates and latencies, the largest RSS."""
    summary = []
    for server, conc in dict.fromkeys((row.server, row.conc) for row in rows):
        mine = [row for row in rows if (row.server, row.conc) == (server, conc)]
        summary.append(
            Row(
                server,
                conc,
                sum(row.requests for row in mine),
                sum(row.errors for row in mine),
                _median([row.output_tok_s for row in mine]),
                _median([row.ttft_p50_ms for row in mine]),
                _median([row.ttft_p99_ms for row in mine]),
                _median([row.itl_p50_ms for row in mine]),
                max(row.peak_rss_mib for row in mine),
                len(mine),
            )
        )
    return summary


# ---- outputs ------------------------------------------------------------------------------------------------


def write_csv(rows: list[Row], path: Path) -> None:
    with path.open("w", newline="") as sink:
        writer = csv.writer(sink)
        writer.writerow([f.name for f in fields(Row)])
        writer.writerows(["" if value is None else value for value in astuple(row)] for row in rows)


def _num(value: float | None) -> float:
    return float("nan") if value is None else value


def write_png(rows: list[Row], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (tput, ttft) = plt.subplots(1, 2, figsize=(11, 4.2), layout="constrained")
    concs = sorted({row.conc for row in rows})
    for name in dict.fromkeys(row.server for row in rows):
        mine = sorted((row for row in rows if row.server == name), key=lambda row: row.conc)
        label = TITLES.get(name, name)
        tput.plot([r.conc for r in mine], [_num(r.output_tok_s) for r in mine], marker="o", label=label)
        ttft.plot([r.conc for r in mine], [_num(r.ttft_p50_ms) for r in mine], marker="o", label=label)
    for ax, title, ylabel in (
        (tput, "Output throughput", "output tokens/s"),
        (ttft, "Time to first token (p50)", "TTFT p50 (ms)"),
    ):
        ax.set_xscale("log", base=2)
        ax.set_xticks(concs, [str(c) for c in concs])
        ax.minorticks_off()
        ax.set(title=title, xlabel="concurrent requests", ylabel=ylabel)
        ax.set_ylim(bottom=0)
        ax.grid(True, alpha=0.3)
        ax.legend()
    fig.suptitle(f"{MODEL} on CPU ({os.cpu_count()} cores)")
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _fmt(value: float | None) -> str:
    return "—" if value is None else f"{value:g}"


def markdown_table(rows: list[Row]) -> str:
    """One row per server and level; with hybridserve in the run, its tok/s over each other server's."""
    tok_s = {(row.server, row.conc): row.output_tok_s for row in rows}
    present = {row.server for row in rows}
    peers = [name for name in SERVERS if name != "hybridserve" and name in present] if "hybridserve" in present else []
    head = ["server", "conc", "output tok/s", "TTFT p50 ms", "TTFT p99 ms", "ITL p50 ms", "peak RSS MiB", "errors"]
    head += [f"tok/s hybridserve/{TITLES[peer]}" for peer in peers]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for row in sorted(rows, key=lambda row: (row.conc, SERVERS.index(row.server))):
        cells = [TITLES[row.server], str(row.conc), _fmt(row.output_tok_s), _fmt(row.ttft_p50_ms)]
        cells += [_fmt(row.ttft_p99_ms), _fmt(row.itl_p50_ms), _fmt(row.peak_rss_mib), f"{row.errors}/{row.requests}"]
        for peer in peers:
            other = tok_s.get((peer, row.conc))
            ok = row.server == "hybridserve" and row.output_tok_s and other
            cells.append(f"{row.output_tok_s / other:.2f}×" if ok else "")
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


# ---- command line -------------------------------------------------------------------------------------------


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--servers", default="hybridserve,vllm", help="comma list from: " + ", ".join(SERVERS))
    p.add_argument("--conc", default="1,8,32,64", help="concurrency levels, one loadgen run (and RSS peak) each")
    p.add_argument("--max-tokens", type=int, default=128, help="output tokens per request (ignore_eos)")
    p.add_argument("--waves", type=int, default=1, help="requests per level = conc * waves")
    p.add_argument("--prompt", choices=["short", "long"], default="short", help="loadgen prompt length")
    p.add_argument("--out", type=Path, default=REPO / "benchmarks" / "results", help="results folder")
    p.add_argument("--port", type=int, default=8017, help="port each server binds in turn (127.0.0.1)")
    p.add_argument("--bench-dir", type=Path, default=REPO.parent / "shared" / "bench", help="loadgen + peer scripts")
    p.add_argument("--hybridserve-args", default="", help="extra arguments for `hybridserve serve`, one string")
    p.add_argument("--peer-root", type=Path, default=Path(os.environ.get("PEER_ROOT", "/tmp/peer")), help="peers")
    p.add_argument("--vllm-dtype", default=same_dtype_as_engine(), help="vLLM's --dtype (default: the engine's auto)")
    p.add_argument("--vllm-args", default="", help="extra arguments for vLLM's api_server, one string")
    p.add_argument("--startup-timeout", type=float, default=900.0, help="seconds to wait for /health")
    p.add_argument("--baseline", type=Path, default=None, help="an earlier hybridserve checkout, served as `baseline`")
    p.add_argument("--rounds", type=int, default=1, help="run the servers this many times, alternating their order")
    args = p.parse_args(argv)
    args.servers = [s.strip() for s in args.servers.split(",") if s.strip()]
    if not args.servers or any(s not in SERVERS for s in args.servers):
        p.error(f"--servers: expected a comma list from {', '.join(SERVERS)}, got {','.join(args.servers)!r}")
    if "baseline" in args.servers and (args.baseline is None or not (args.baseline / "hybridserve").is_dir()):
        p.error(f"--baseline: server `baseline` needs a hybridserve checkout, got {args.baseline}")
    try:
        args.conc = [int(c) for c in args.conc.split(",")]
    except ValueError:
        p.error(f"--conc: expected comma-separated integers, got {args.conc!r}")
    if any(c < 1 for c in args.conc) or args.max_tokens < 1 or args.waves < 1 or args.rounds < 1:
        p.error("--conc levels, --max-tokens, --waves and --rounds must be positive")
    for script in ("loadgen.py", "peer-vllm.sh"):
        if not (args.bench_dir / script).is_file():
            p.error(f"--bench-dir: {args.bench_dir / script} not found")
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        p.error("matplotlib is missing: .venv/bin/pip install -e '.[bench]'")
    args.stamp = time.strftime("%Y%m%d-%H%M%S")
    return args


def _raise_interrupt(signum: int, frame: object) -> None:
    raise KeyboardInterrupt(f"signal {signum}")


def write_outputs(rows: list[Row], args: argparse.Namespace) -> None:
    csv_path, png_path = args.out / f"serving_{args.stamp}.csv", args.out / f"serving_{args.stamp}.png"
    write_csv(rows, csv_path)
    summary = summarise(rows)
    write_png(summary, png_path)
    say(f"wrote {csv_path} and {png_path}")
    rounds = max(row.round for row in rows) + 1
    if rounds > 1:
        print(f"Medians over {rounds} rounds (servers in reverse order every other round):", flush=True)
    print(markdown_table(summary), flush=True)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    signal.signal(signal.SIGTERM, _raise_interrupt)  # so `finally` stops the server on kill too
    rows: list[Row] = []
    failed: list[str] = []
    try:
        for round_ in range(args.rounds):
            for name in args.servers if round_ % 2 == 0 else reversed(args.servers):
                if name in failed:
                    continue
                try:
                    bench_server(name, args, rows, round_)
                except ServerFailed as exc:
                    say(f"ERROR: {exc}")
                    failed.append(name)
    except KeyboardInterrupt as exc:
        say(f"interrupted ({str(exc) or 'Ctrl-C'}); servers stopped")
        return 130
    finally:
        if rows:  # partial results too: every finished level is worth keeping
            write_outputs(rows, args)
    if failed:
        say(f"failed: {', '.join(failed)}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())

"""Starting ranks: `run` (one rank, as torchrun starts it) and `launch` (this machine's ranks
through PyTorch's elastic launcher, the machinery behind `torchrun`).

Devices (`orthoptim.train.devices`): gloo ranks on CPU; on CUDA rank r on cuda:LOCAL_RANK over
NCCL, or with `--shared-gpu` every rank on cuda:0 over "cuda:gloo".
"""

from __future__ import annotations

import contextlib
import dataclasses
import datetime
import json
import logging
import os
import signal
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from torch.distributed.elastic.multiprocessing.api import DefaultLogsSpecs

from orthoptim import collectives
from orthoptim.train import devices
from orthoptim.train.args import TrainArgs
from orthoptim.train.board import summary_writer
from orthoptim.train.data import load_corpus
from orthoptim.train.devices import plan_ranks
from orthoptim.train.loop import Preempted, StopRequest, setup_logging, train
from orthoptim.train.microbatch import REPRODUCIBLE_THREADS, reproducible_rank
from orthoptim.train.model import get_config
from orthoptim.train.runfolder import (
    RunLogHandler,
    acquire_lock,
    atomic_write_text,
    claim_out,
    clean_leftovers,
    disk_full_error,
    forget_unstepped,
    is_disk_full,
    latest_record,
    no_space,
    nothing_to_do,
    raised_from,
    release_lock,
)

if TYPE_CHECKING:
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError


def _init_distributed(
    shared_gpu: bool = False, timeout: float | None = None
) -> tuple[int, int, torch.device]:
    """Take this rank's device (`plan_ranks` over this machine's ranks: cuda:LOCAL_RANK, cuda:0
    with `shared_gpu`, or the CPU) and join the process group the launcher described in the
    environment (if any) with the plan's backend (NCCL, "cuda:gloo" or gloo); `timeout`
    (--pg-timeout, seconds) bounds every wait of its collectives."""
    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    local = int(os.environ.get("LOCAL_RANK", "0"))
    local_world = int(os.environ.get("LOCAL_WORLD_SIZE", str(world_size)))
    plan = plan_ranks(local_world, devices.visible_gpus(), shared_gpu)
    device = plan.device(local)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    if world_size > 1 and not dist.is_initialized():
        # NCCL binds the rank to its GPU at init (no guessing the device of a barrier).
        kw: dict[str, Any] = {"device_id": device} if plan.backend == "nccl" else {}
        if timeout is not None:
            kw["timeout"] = datetime.timedelta(seconds=timeout)
        dist.init_process_group(plan.backend, **kw)
    rank, world_size = collectives.world()
    if device.type == "cuda":
        return rank, world_size, device
    if "OMP_NUM_THREADS" not in os.environ:
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // local_world))
    return rank, world_size, torch.device("cpu")


def run(args: TrainArgs) -> dict[str, Any]:
    """Train on this rank (joining the launcher's process group if there is one), as started
    by torchrun: rank 0 takes --out's lock and checks the folder (`claim_out`), every rank
    follows its verdict. (`launch` does that once, before starting the ranks.)

    Returns the run's summary (the content of result.json) on every rank. Ranks torchrun
    restarted (its --max-restarts) resume (`_restarted`); a stop signal raises `Preempted`
    once the step is saved.
    """
    with _stop_on_signals(args) as stop:
        return _claim_and_run(_restarted(args), stop)


def _claim_and_run(args: TrainArgs, stop: StopRequest) -> dict[str, Any]:
    """`run`'s work, the stop signals caught."""
    args.validate()
    rank, world_size, device = _init_distributed(args.shared_gpu, args.pg_timeout)
    out = Path(args.out)
    lock, done, error = None, None, None
    if rank == 0:
        try:
            check_folders(args)
            lock = acquire_lock(out)
            # A restart with no checkpoint yet starts afresh in the folder the first start claimed.
            if args.resume or not _restart_count():
                done = claim_out(args, world_size, device.type)
        except (ValueError, FileNotFoundError) as e:
            error = e
    # rank 0's verdict: 0 train, 1 nothing to do, 2 refused
    mine = float(2 if error else 1 if done else 0) if rank == 0 else 0.0
    (verdict,) = collectives.sum_floats([mine])
    try:
        if error is not None:
            raise error
        if verdict == 2:
            raise ValueError(f"rank 0 refused --out {out} (see its error)")
        if verdict == 1:
            return nothing_to_do(out, done or f"--out {out}: nothing to do (see rank 0)")
        return _run_rank(args, stop)
    finally:
        if lock is not None:
            release_lock(lock)


def _restart_count() -> int:
    """How often torchelastic restarted this rank's group (0: its first start)."""
    return int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))


def _committed_step(out: Path) -> int | None:
    """The step of the checkpoint a --resume of `out` would continue from (`latest_record`);
    None without one."""
    record = latest_record(out)
    return int(record["step"]) if record else None


def _restarted(args: TrainArgs) -> TrainArgs:
    """The arguments of a rank torchelastic restarted after a failure: the first start's,
    resuming from the last checkpoint as --resume does, or, none committed yet, starting
    afresh (metrics.jsonl rewritten). A first start's are returned as they are."""
    if not _restart_count():
        return args
    resume = _committed_step(Path(args.out)) is not None
    return dataclasses.replace(args, resume=resume, overwrite=False)


@contextlib.contextmanager
def _stop_on_signals(args: TrainArgs) -> Iterator[StopRequest]:
    """While this rank runs, its stop signals (SIGTERM, --save-on-signal's) only set the
    `StopRequest` the step loop reads, so the rank finishes its step and saves it; the
    handlers before are restored after. Python takes handlers in the main thread only:
    elsewhere nothing is caught."""
    stop = StopRequest()
    if threading.current_thread() is not threading.main_thread():
        yield stop
        return
    saved = {s: signal.getsignal(s) for s in args.stop_signals}
    for s in saved:
        signal.signal(s, lambda signum, _frame: stop.set(signal.Signals(signum).name))
    try:
        yield stop
    finally:
        for s, handler in saved.items():
            signal.signal(s, handler)


def _run_rank(args: TrainArgs, stop: StopRequest) -> dict[str, Any]:
    """One rank's training, --out already checked; under --reproducible with
    REPRODUCIBLE_THREADS intra-op threads whatever --nproc and OMP_NUM_THREADS
    (`reproducible_rank`)."""
    args.validate()
    rank, world_size, device = _init_distributed(args.shared_gpu, args.pg_timeout)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    collectives.barrier()
    log = setup_logging(out, rank)
    try:
        with reproducible_rank(args.reproducible):
            return train(args, rank, world_size, device, out, log, stop)
    finally:
        _close(log)


def _close(log: logging.Logger) -> None:
    for h in list(log.handlers):
        log.removeHandler(h)
        h.close()


def _elastic_entry(args_dict: dict[str, Any]) -> dict[str, Any]:
    """What each rank started by `launch` runs (module level, so it pickles): the rank's
    training with a heartbeat for the launcher's watchdog and its failure recorded; after a
    restart, resumed (`_restarted`). A rank stopped by a signal exits at once with
    `Preempted.EXIT_CODE` (rank 0 left the stop's record for the launcher): a return would
    wait for a launcher that is shutting down to collect it."""
    try:
        return _run_recorded(_restarted(TrainArgs.from_dict(args_dict)), heartbeat=True)
    except Preempted:
        raise SystemExit(Preempted.EXIT_CODE) from None


def launch(args: TrainArgs, nproc: int | None = None) -> dict[str, Any]:
    """Start `nproc` ranks on this machine through torch's elastic launcher and wait for them.

    `nproc` None: one per visible GPU, or 2 on CPU (or with --shared-gpu); more ranks than
    GPUs are refused here, before anything starts (`plan_ranks`), and so is an --out another
    run holds or uses (`acquire_lock`, `claim_out`; the lock is held until the ranks end,
    restarts included). One rank without --max-restarts runs in this process with no process
    group. Returns rank 0's result; with nothing to do (resuming a finished run) the folder's
    result.json untouched, plus "nothing_to_do". A stop signal raises `Preempted`.
    """
    args.validate()
    plan = plan_ranks(nproc, devices.visible_gpus(), args.shared_gpu)
    nproc = plan.nproc
    args.check_nproc(nproc, plan.device_type)
    out = Path(args.out)
    folders = [out, *([Path(args.tensorboard)] if args.tensorboard else [])]
    created = [folder for folder in folders if not folder.exists()]
    try:
        check_folders(args)
    except ValueError:
        _remove_empty(created)
        raise
    lock = acquire_lock(out)
    try:
        done = claim_out(args, nproc, plan.device_type)
        if done is not None:
            return nothing_to_do(out, done)
        # A bad --data fails here, once, before any rank starts.
        load_corpus(args.data, min_bytes=get_config(args.config).seq_len + 1)
        if plan.device_type == "cpu":
            _warn_oversubscribed(nproc)
        return _launch_ranks(args, nproc)
    except RankFailedError:
        if not args.resume:  # a run that never stepped leaves no run behind
            forget_unstepped(out)
        raise
    finally:
        release_lock(lock)
        _remove_empty(created)  # a refused run leaves no empty folder behind


def _warn_oversubscribed(nproc: int) -> None:
    """One line on stderr when `nproc` CPU ranks outnumber this machine's cores: they start
    and step slowly, and nothing else is printed until the first step ends."""
    cores = os.cpu_count() or 1
    if nproc > cores:
        print(
            f"orthoptim: starting {nproc} ranks on {cores} CPU cores: more ranks than cores, "
            f"so each gets a share of one and they start and step slowly (--nproc {cores} "
            "fits this machine)",
            file=sys.stderr,
            flush=True,
        )


def _remove_empty(folders: list[Path]) -> None:
    """Remove those of `folders` (the ones this launch created) that are empty."""
    for folder in folders:
        with contextlib.suppress(OSError):
            folder.rmdir()


def _launch_ranks(args: TrainArgs, nproc: int) -> dict[str, Any]:
    """Run the ranks; a failure comes back as one `RankFailedError` (the first failing rank's
    exception, or the rank the watchdog found stalled) once --max-restarts restarts are
    spent (each said on stderr and in the launcher log, `RestartPolicy`), Ctrl-C as
    KeyboardInterrupt, a stop signal as `Preempted`, and torch's launcher reports go to
    OUT/logs/launcher.log instead of the terminal.

    A stop signal to this process is torch's launcher's to forward: it sends it to the
    ranks, waits TORCH_ELASTIC_SHUTDOWN_TIMEOUT seconds (default 30) for them to end, then
    kills them."""
    logs = Path(args.out) / "logs"
    _clear_records(logs)
    if nproc == 1 and not args.max_restarts:
        try:
            return _run_recorded(args, heartbeat=False)
        except Preempted:
            raise
        except Exception as exc:
            message = _failure_message(logs, 1, args.pg_timeout, local=exc)
            raise RankFailedError(message) from exc
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.launcher.api import LaunchConfig, elastic_launch

    watchdog = _Watchdog(logs, nproc, args.pg_timeout)
    handled = dict.fromkeys(["SIGTERM", "SIGINT", "SIGHUP", "SIGQUIT", args.save_on_signal])
    config = LaunchConfig(
        min_nodes=1,
        max_nodes=1,
        nproc_per_node=nproc,
        run_id=f"orthoptim-{os.getpid()}-{time.time_ns()}",
        rdzv_backend="c10d",
        rdzv_endpoint="localhost:0",
        max_restarts=args.max_restarts,
        monitor_interval=0.1,
        start_method="spawn",
        signals_to_handle=",".join(n for n in handled if n),
        logs_specs=_Attempts(args, nproc, watchdog),
    )
    # Ranks share this machine's cores: cores / nproc threads each unless the user set
    # OMP_NUM_THREADS; under --reproducible REPRODUCIBLE_THREADS at every --nproc.
    saved = os.environ.get("OMP_NUM_THREADS")
    threads = saved or str(max(1, (os.cpu_count() or 1) // nproc))
    os.environ["OMP_NUM_THREADS"] = str(REPRODUCIBLE_THREADS) if args.reproducible else threads
    handlers = {s: signal.getsignal(s) for s in (signal.SIGINT, *args.stop_signals)}
    _start_resource_tracker(args.stop_signals)
    started = time.time()
    try:
        with _launcher_log(logs / LAUNCHER_LOG), _own_store_per_attempt(args.max_restarts > 0):
            watchdog.start()
            results = elastic_launch(config, _elastic_entry)(args.to_dict())
    except SignalException as exc:
        if exc.sigval == signal.SIGINT:
            raise KeyboardInterrupt from None
        if exc.sigval not in args.stop_signals:
            raise
        return _after_stop_signal(args, signal.Signals(exc.sigval), started)
    except ChildFailedError as exc:
        if stopped := _read_json(logs / STOP_FILE):  # the ranks alone were signalled
            raise Preempted(stopped["signal"], stopped["step"]) from None
        message = _failure_message(logs, nproc, args.pg_timeout, exc, watchdog.found)
        if args.max_restarts:
            n = args.max_restarts
            message += f" (after {n} restart{'s' * (n > 1)})"
        raise RankFailedError(message) from exc
    finally:
        watchdog.stop()
        if threading.current_thread() is threading.main_thread():  # where it installs its own
            for sig, handler in handlers.items():
                signal.signal(sig, handler)
        if saved is None:
            del os.environ["OMP_NUM_THREADS"]
    return results[0]


@contextlib.contextmanager
def _own_store_per_attempt(restarts: bool) -> Iterator[None]:
    """With `restarts`, each attempt's ranks meet in a store of their own (rank 0's, torch's
    TORCH_DISABLE_SHARE_RDZV_TCP_STORE): the launcher's shared store outlives an attempt, and
    a restarted process group could read the failed attempt's addresses from it (2 of 3
    restarts failed so, "Gloo connectFullMesh failed ... Connection refused")."""
    name = "TORCH_DISABLE_SHARE_RDZV_TCP_STORE"
    saved = os.environ.get(name)
    if restarts and saved is None:
        os.environ[name] = "1"
    try:
        yield
    finally:
        if saved is None:
            os.environ.pop(name, None)


def _start_resource_tracker(ignoring: tuple[signal.Signals, ...]) -> None:
    """Start multiprocessing's resource tracker (the spawned ranks' shared-memory janitor, a
    child of this process) ignoring the stop signals, as it ignores SIGTERM itself: a signal
    to the whole process group (a scheduler's) would otherwise end it with tracebacks."""
    from multiprocessing import resource_tracker

    if threading.current_thread() is not threading.main_thread():
        return
    saved = {s: signal.signal(s, signal.SIG_IGN) for s in ignoring}
    try:
        resource_tracker.ensure_running()
    finally:
        for s, handler in saved.items():
            signal.signal(s, handler)


def _after_stop_signal(args: TrainArgs, sig: signal.Signals, started: float) -> dict[str, Any]:
    """What a stop signal to the launcher left, its ranks ended: `Preempted` naming the step
    they saved (rank 0's stop record), or, where they ended before saving (the signal came
    before their handlers, or they overran torch's grace period), the checkpoint that is
    left. A run that finished meanwhile returns its result."""
    out = Path(args.out)
    stopped = _read_json(out / "logs" / STOP_FILE)
    if stopped is not None:
        raise Preempted(stopped["signal"], stopped["step"])
    result = out / "result.json"
    with contextlib.suppress(OSError, ValueError):
        if result.stat().st_mtime >= started:
            return json.loads(result.read_text())
    raise Preempted(sig.name, _committed_step(out) or 0, saved=False, signum=int(sig))


def _attempt_failure(
    logs: Path, nproc: int, limit: float, stalled: tuple[int, dict[str, Any], float] | None
) -> str:
    """Why an attempt of the ranks failed (called once every rank of it ended), as
    `_failure_message` says it, a rank that left its heartbeat behind (it died without a
    record; its exit status is torch's to know) named before another's knock-on failure."""
    records = [_read_json(logs / FAILURE_FILE.format(rank=n)) for n in range(nproc)]
    if stalled is None and not any(r and not r["knock_on"] for r in records):
        for rank in range(nproc):
            if beat := _read_json(logs / HEARTBEAT_FILE.format(rank=rank)):
                return f"rank {rank} died after step {beat['step']}; logs: {logs}"
    return _failure_message(logs, nproc, limit, stalled=stalled)


class RestartPolicy:
    """What the launcher does between two attempts of the ranks under --max-restarts
    (torchelastic restarts the whole group when a rank fails or the watchdog finds one
    stalled), once every rank of the last attempt ended and before the next starts: ranks
    that a stop signal ended (their exit status is not 0) are not restarted, `Preempted` ends
    the launch; after a failure the restart is said (stderr and the launcher log) from what
    that attempt left, naming its cause and the step the next attempt resumes from, and its
    failure records, heartbeats and half-written checkpoint files are cleared for the next.
    The restarted ranks resume from the last checkpoint, or start afresh without one
    (`_restarted`)."""

    def __init__(self, args: TrainArgs, nproc: int, watchdog: _Watchdog) -> None:
        self.args, self.nproc, self.watchdog = args, nproc, watchdog

    def before_attempt(self, count: int) -> None:
        """Prepare attempt `count` of the ranks (0: the first start, which needs nothing)."""
        if not count:
            return
        out = Path(self.args.out)
        stopped = _read_json(out / "logs" / STOP_FILE)
        if stopped:  # the ranks alone were signalled: a stop, not a failure
            raise Preempted(stopped["signal"], stopped["step"])
        line = self.restart_line(count)
        _LOG.warning("%s", line)
        print(f"orthoptim: {line}", file=sys.stderr, flush=True)
        _clear_records(out / "logs")
        for path in clean_leftovers(out):
            _LOG.warning("removed %s, left by the failed attempt", path)
        self.watchdog.found = None

    def restart_line(self, count: int) -> str:
        """Why the ranks' last attempt failed and where attempt `count` resumes, in one line."""
        out = Path(self.args.out)
        cause = _attempt_failure(
            out / "logs", self.nproc, self.args.pg_timeout, self.watchdog.found
        )
        step = _committed_step(out)
        whence = f"from the checkpoint of step {step}" if step is not None else "afresh"
        return (
            f"{cause}; restarting the ranks {whence} (restart {count} of {self.args.max_restarts})"
        )


class _Attempts(DefaultLogsSpecs):
    """torch's default logs layout, and the hook of the `RestartPolicy`: torch asks for the
    next attempt's logs (`reify`) once the failed attempt's ranks ended and before new ones
    start."""

    def __init__(self, args: TrainArgs, nproc: int, watchdog: _Watchdog) -> None:
        super().__init__()
        self.policy = RestartPolicy(args, nproc, watchdog)

    def reify(self, envs: dict[int, dict[str, str]]) -> Any:
        self.policy.before_attempt(
            int(envs[0].get("TORCHELASTIC_RESTART_COUNT", "0")) if envs else 0
        )
        return super().reify(envs)


# -- failures: each rank records its own, the launcher reports the first one ----------------

LAUNCHER_LOG = "launcher.log"  # torch's launcher reports and the watchdog's, under OUT/logs
FAILURE_FILE = "rank{rank}.error.json"
HEARTBEAT_FILE = "rank{rank}.heartbeat.json"
STOP_FILE = "stopped.json"  # rank 0's: the signal that stopped the run, the step it saved
HEARTBEAT_S = 1.0
MESSAGE_CHARS = 400  # an exception's message is cut to this in the one-line report
_LOG = logging.getLogger("orthoptim.launcher")


class RankFailedError(RuntimeError):
    """A rank failed or stalled; the message is the one-line report (rank, phase, exception,
    the log holding its traceback)."""


def check_out(out: Path, flag: str = "--out") -> None:
    """Refuse a run folder that cannot be created or written (a file, a read-only or virtual
    file system, a full disk), naming `flag` and the OS's reason, before anything starts."""
    if out.exists() and not out.is_dir():
        raise ValueError(f"{flag} {out} is a file; pass a folder (it is created if missing)")
    probe = out / f".probe-{os.getpid()}"
    try:
        out.mkdir(parents=True, exist_ok=True)
        probe.write_text("written by orthoptim to see that the folder takes files\n")
        probe.unlink()
    except OSError as e:
        with contextlib.suppress(OSError):
            probe.unlink()
        if is_disk_full(e):
            raise ValueError(
                f"{flag} {out}: {no_space(out)}; free space there or pass another {flag}"
            ) from e
        raise ValueError(
            f"{flag} {out}: cannot write a run folder there ({e.strerror or e}); "
            "pass a writable folder"
        ) from e


def check_folders(args: TrainArgs) -> None:
    """Refuse, before any rank starts, an --out (`check_out`) or --tensorboard folder that
    cannot be created or written, or a --tensorboard without TensorBoard installed: one
    line naming the flag."""
    check_out(Path(args.out))
    if args.tensorboard:
        summary_writer(args.tensorboard)
        check_out(Path(args.tensorboard), "--tensorboard")


class _Progress:
    """This process's optimizer steps, as torch's global step hooks see them: the last step
    done (counting from `start`, where a resumed run continues) and whether one is under way.
    The loop's optimizers nest (an outer step steps inner ones), so the steps done are the
    most any one optimizer took; `on_step` (if set) is called each time that count grows."""

    on_step: Callable[[], None] | None = None

    def __init__(self, start: int) -> None:
        from torch.optim.optimizer import (
            register_optimizer_step_post_hook,
            register_optimizer_step_pre_hook,
        )

        self.start, self.done = start, 0
        self._begun: dict[int, int] = {}
        self._ended: dict[int, int] = {}
        self._hooks = [
            register_optimizer_step_pre_hook(self._pre),
            register_optimizer_step_post_hook(self._post),
        ]

    def _pre(self, opt: Any, *_: Any) -> None:
        self._begun[id(opt)] = self._begun.get(id(opt), 0) + 1

    def _post(self, opt: Any, *_: Any) -> None:
        self._ended[id(opt)] = n = self._ended.get(id(opt), 0) + 1
        if n > self.done:
            self.done = n
            if self.on_step is not None:
                self.on_step()

    @property
    def step(self) -> int:
        return self.start + self.done

    def phase(self) -> str:
        """Where the rank is: before step 1, in the optimizer step of step N, or after step N
        (its forward, backward, evaluation or checkpoint)."""
        if any(n > self._ended.get(k, 0) for k, n in self._begun.items()):
            return f"in the optimizer step of step {self.step + 1}"
        return f"after step {self.step}" if self.step else "before step 1"

    def close(self) -> None:
        for h in self._hooks:
            h.remove()


def _resume_step(args: TrainArgs) -> int:
    """The step a --resume run continues from (0 otherwise, or when unreadable)."""
    return (_committed_step(Path(args.out)) if args.resume else None) or 0


class _Heartbeat:
    """A thread writing {"pid", "step", "time"} to OUT/logs/rank{R}.heartbeat.json every
    HEARTBEAT_S, and the rank writing it at the end of each optimizer step, so its step is the
    rank's. It keeps beating while the rank waits in a collective and stops when the process
    is stopped or hangs holding the interpreter: what the launcher's watchdog looks for. The
    file is removed when the rank ends, so one left behind marks a rank that died."""

    def __init__(self, path: Path, progress: _Progress) -> None:
        self.path, self.progress = path, progress
        self._stop = threading.Event()
        self._writing = threading.Lock()  # the thread and the step hook share path.tmp
        path.parent.mkdir(parents=True, exist_ok=True)
        self._beat_once()
        progress.on_step = self._beat_once
        self._thread = threading.Thread(target=self._beat, name="orthoptim-heartbeat", daemon=True)
        self._thread.start()

    def _write(self) -> None:
        beat = dict(pid=os.getpid(), step=self.progress.step, time=time.time())
        with self._writing:
            atomic_write_text(json.dumps(beat), self.path)

    def _beat_once(self) -> None:
        with contextlib.suppress(OSError):  # a full disk fails the run elsewhere, by name
            self._write()

    def _beat(self) -> None:
        while not self._stop.wait(HEARTBEAT_S):
            self._beat_once()

    def stop(self) -> None:
        self.progress.on_step = None
        self._stop.set()
        self._thread.join()
        self.path.unlink(missing_ok=True)


def _run_recorded(args: TrainArgs, heartbeat: bool) -> dict[str, Any]:
    """`_run_rank`, its failure written to the rank's log (with the traceback) and to
    OUT/logs/rank{R}.error.json for the launcher to report; with `heartbeat` a `_Heartbeat`
    beats meanwhile. Ctrl-C (KeyboardInterrupt) is no failure: it is not recorded, nor is a
    stop signal's `Preempted` (rank 0 writes OUT/logs/stopped.json for the launcher)."""
    with _stop_on_signals(args) as stop:
        return _record_run(args, heartbeat, stop)


def _record_run(args: TrainArgs, heartbeat: bool, stop: StopRequest) -> dict[str, Any]:
    """`_run_recorded`'s work, the stop signals caught."""
    rank = int(os.environ.get("RANK", "0"))
    out = Path(args.out)
    progress = _Progress(_resume_step(args))
    path = out / "logs" / HEARTBEAT_FILE.format(rank=rank)
    beat = _Heartbeat(path, progress) if heartbeat else None
    joins = not dist.is_initialized()  # the group this rank joins is its own to end
    try:
        return _run_rank(args, stop)
    except Preempted as stopped:
        if rank == 0:
            record = dict(signal=stopped.signal, step=stopped.step)
            atomic_write_text(json.dumps(record), out / "logs" / STOP_FILE)
        raise
    except Exception as exc:
        full = disk_full_error(exc, out)
        _record_failure(out, rank, full or exc, progress.phase())
        if full is not None:
            raise full from exc
        raise
    finally:
        if beat is not None:
            beat.stop()
        progress.close()
        if joins and dist.is_initialized():
            dist.destroy_process_group()


# What gloo's transport says when the peer's process is gone, in the plain RuntimeError of a
# collective torch issues itself (FSDP2's gathers), not through `collectives`.
_PEER_GONE = ("Connection closed by peer", "Connection reset by peer")


def _is_knock_on(exc: BaseException) -> bool:
    """Whether `exc` only echoes another rank's failure: a collective failed (a peer died or
    stalled), or an error says so itself (`knock_on`, e.g. a checkpoint save another rank
    failed), or it was raised from a connection a dead peer closed."""
    if type(exc) is collectives.CollectiveError or isinstance(exc, dist.DistError):
        return True
    if getattr(exc, "knock_on", False) is True:
        return True
    return any(
        isinstance(e, RuntimeError) and any(m in str(e) for m in _PEER_GONE)
        for e in raised_from(exc)
    )


def _record_failure(out: Path, rank: int, exc: Exception, phase: str) -> None:
    knock_on = _is_knock_on(exc)
    # Notes first (`collectives.phase` names where a local error was raised): the one-line
    # report cuts the message.
    text = str(exc)
    notes = [n for n in getattr(exc, "__notes__", ()) if n not in text]
    record = dict(
        rank=rank,
        type=type(exc).__name__,
        message="; ".join([*notes, text]),
        phase=phase,
        knock_on=knock_on,
        time=time.time(),
        log=str(out / "logs" / f"rank{rank}.log"),
    )
    with contextlib.suppress(OSError):
        log = setup_logging(out, rank)
        try:
            log.error("failed %s", phase, exc_info=exc)
        finally:
            _close(log)
        atomic_write_text(json.dumps(record), out / "logs" / FAILURE_FILE.format(rank=rank))


def _read_json(path: Path) -> dict[str, Any] | None:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


def _clear_records(logs: Path) -> None:
    """Remove a previous launch's (or attempt's) failure records, heartbeats and stop record
    from `logs` (and what a write of one cut short left: `*.tmp`)."""
    for pattern in (FAILURE_FILE, HEARTBEAT_FILE, STOP_FILE):
        for name in (pattern, pattern + ".tmp"):
            for path in logs.glob(name.format(rank="*")):
                path.unlink(missing_ok=True)


def _stalled(logs: Path, nproc: int, limit: float) -> tuple[int, dict[str, Any], float] | None:
    """The rank whose heartbeat is oldest, if older than `limit` seconds: (rank, its last
    heartbeat, its age)."""
    now = time.time()
    beats = [
        (r, b) for r in range(nproc) if (b := _read_json(logs / HEARTBEAT_FILE.format(rank=r)))
    ]
    if not beats:
        return None
    rank, beat = min(beats, key=lambda rb: rb[1]["time"])
    age = now - beat["time"]
    return (rank, beat, age) if age > limit else None


def _is_child(pid: int) -> bool:
    """Whether `pid` is a process this one started (Linux's /proc; False elsewhere)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return int(stat.rsplit(")", 1)[1].split()[1]) == os.getpid()


class _Watchdog:
    """A thread of the launcher that stops the run when a rank has stalled: its heartbeat
    is older than `limit` (--pg-timeout) seconds, so its process is stopped or hangs. The
    stalled rank is killed, so the others' collectives fail at once and the launcher ends
    the run (or restarts it: the watchdog keeps watching); `_failure_message` then names the
    rank."""

    def __init__(self, logs: Path, nproc: int, limit: float) -> None:
        self.logs, self.nproc, self.limit = logs, nproc, limit
        self.found: tuple[int, dict[str, Any], float] | None = None  # what `_stalled` said
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._watch, name="orthoptim-watchdog", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join()

    def _watch(self) -> None:
        killed: set[int] = set()
        while not self._stop.wait(min(HEARTBEAT_S, self.limit / 4)):
            found = _stalled(self.logs, self.nproc, self.limit)
            if found is None or found[1]["pid"] in killed:
                continue
            self.found = found
            rank, beat, age = found
            _LOG.error(
                "rank %d (pid %d) stalled after step %d: no heartbeat for %.1f s "
                "(--pg-timeout %g); stopping it",
                rank, beat["pid"], beat["step"], age, self.limit,
            )  # fmt: skip
            if _is_child(beat["pid"]):
                with contextlib.suppress(OSError):
                    os.kill(beat["pid"], signal.SIGKILL)
            killed.add(beat["pid"])


@contextlib.contextmanager
def _launcher_log(path: Path) -> Iterator[None]:
    """While the ranks run, torch's launcher loggers (its failure tracebacks among them) and
    this module's write to `path` instead of the terminal (once its disk is full, one line
    says so: `RunLogHandler`)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    handler = RunLogHandler(path)
    handler.setFormatter(logging.Formatter("%(asctime)s %(name)s %(levelname)s %(message)s"))
    names = ("torch.distributed.elastic", "torch.distributed.launcher", "torch.multiprocessing")
    loggers = [logging.getLogger(n) for n in (*names, _LOG.name)]
    saved = [lg.propagate for lg in loggers]
    for lg in loggers:
        lg.addHandler(handler)
        lg.propagate = False
    try:
        yield
    finally:
        for lg, propagate in zip(loggers, saved):
            lg.removeHandler(handler)
            lg.propagate = propagate
        handler.close()


def _short(message: str) -> str:
    text = " ".join(message.split())
    return text if len(text) <= MESSAGE_CHARS else text[: MESSAGE_CHARS - 1] + "…"


def _failure_message(
    logs: Path,
    nproc: int,
    limit: float,
    failed: ChildFailedError | None = None,
    stalled: tuple[int, dict[str, Any], float] | None = None,
    local: Exception | None = None,
) -> str:
    """One line for the user, the likeliest cause first: the rank the watchdog found
    `stalled`; the first rank's own failure (a record not marked knock-on: its exception's
    type and message, the rank, the phase, the log holding its traceback), or the exception
    torch's launcher kept of a rank that could not write its record (OUT's disk full); a rank
    stalled by now; a rank that died without a record (killed by a signal, then one whose
    heartbeat was left behind as it never ended its run; named with its heartbeat's step);
    last, the first knock-on failure (a collective failed: a peer is gone), or the exception
    itself: `local` (one process) or what torch's launcher kept of it."""
    records = [r for n in range(nproc) if (r := _read_json(logs / FAILURE_FILE.format(rank=n)))]
    causes = sorted(records, key=lambda r: (r["knock_on"], r["time"]))
    recorded = {r["rank"] for r in records}
    unrecorded = {
        rank: failure
        for rank, failure in sorted((failed.failures if failed else {}).items())
        if rank not in recorded
    }
    kept = {rank: m for rank, f in unrecorded.items() if (m := _kept_exception(f)) is not None}
    own = [(rank, m) for rank, m in kept.items() if not _knock_on_text(m)]
    if causes and not causes[0]["knock_on"]:
        cause = _describe(causes[0])
    elif own:
        cause = f"rank {own[0][0]} failed: {_short(own[0][1])}; logs: {logs}"
    else:
        cause = None
    if stalled is None and cause is None:
        stalled = _stalled(logs, nproc, limit)
    if stalled is not None:
        rank, beat, age = stalled
        return (
            f"rank {rank} stalled after step {beat['step']}: no progress for {age:.0f} s "
            f"(--pg-timeout {limit:g}), so the run was stopped; logs: {logs}"
        )
    if cause is not None:
        return cause
    for rank, failure in unrecorded.items():
        if rank not in kept:
            how = failure.signal_name() if failure.exitcode < 0 else f"exit code {failure.exitcode}"
            return f"rank {rank} died{_after(logs, rank)} ({how}); logs: {logs}"
    for rank in range(nproc):
        beat = logs / HEARTBEAT_FILE.format(rank=rank)
        if rank not in recorded and rank not in unrecorded and beat.exists():
            return (
                f"rank {rank} died{_after(logs, rank)} (it left no record and its "
                f"heartbeat behind: killed?); logs: {logs}"
            )
    if causes:
        return _describe(causes[0])
    if kept:
        rank, message = next(iter(kept.items()))
        return f"rank {rank} failed: {_short(message)}; logs: {logs}"
    if local is not None:
        return f"rank 0 failed: {type(local).__name__}: {_short(str(local))}"
    return f"a rank failed; logs: {logs}"


def _after(logs: Path, rank: int) -> str:
    """The words " after step N", N the step of `rank`'s heartbeat ("" without one)."""
    beat = _read_json(logs / HEARTBEAT_FILE.format(rank=rank))
    return f" after step {beat['step']}" if beat else ""


def _kept_exception(failure: Any) -> str | None:
    """The exception ("Type: message") torch's launcher kept of a failed rank (the rank's
    error file), or None for a rank killed by a signal or ended without one."""
    # A rank's exception is a dict (torch's `record`); its own words for a signal or a rank
    # that ended with no error file are a string.
    message = failure.message
    text = message.get("message") if isinstance(message, dict) else None
    return (text.strip() or None) if isinstance(text, str) else None


def _knock_on_text(message: str) -> bool:
    """Whether a kept "Type: message" is a collective's failure (`_is_knock_on` by name)."""
    kind = message.split(":", 1)[0]
    return kind == "CollectiveError" or (kind.startswith("Dist") and kind.endswith("Error"))


def _describe(record: dict[str, Any]) -> str:
    return (
        f"rank {record['rank']} failed {record['phase']}: {record['type']}: "
        f"{_short(record['message'])} (full traceback: {record['log']})"
    )

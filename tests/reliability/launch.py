"""Independent rank processes for the reliability tests: launch, pause, kill, stop, reap, find leftovers.

Each rank is its own OS process with torchrun-like environment variables (``MASTER_ADDR``, ``MASTER_PORT``,
``WORLD_SIZE``, ``LOCAL_RANK``, ``NODE_RANK``), so Lightning treats it as externally launched and starts no
launcher of its own. Two ways to start the processes:

* ``mode="subprocess"``: ``python launch.py CONFIG.json RANK`` (a fresh interpreter, what a user runs);
* ``mode="forkserver"`` (the default): forked from a clean server process that imported torch, Lightning and the
  package once (fast, and free of what earlier tests left in the test process: a gloo process group it holds as
  garbage hung a plain fork's rank in CI, in the group's destructor);
* ``mode="fork"``: a forked child of the test process itself.

A rank runs :func:`rank_main`: a small Lightning fit of ``TinyNet`` with a case of :func:`build_case`, recording
per rank, in ``config["out"]``: ``losses<r>.jsonl`` (one line per batch, written as it goes), ``start<r>.pt``
and ``end<r>.pt`` (state at train start / end), ``warnings<r>.txt`` and, on failure, ``error<r>.txt``. It can
*pause* mid-step (inside the compression hook, after its collectives were issued, or in a gradient hook) and
write ``paused<r>`` so that the test can kill or stop it there, and it can inject NaN/Inf into one gradient.
"""

from __future__ import annotations

import faulthandler
import json
import os
import signal
import subprocess
import sys
import time
import traceback
import warnings
from dataclasses import dataclass, field
from datetime import timedelta
from pathlib import Path
from typing import Any, Callable, Iterator, Optional

import lightning.pytorch as pl
import torch
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.strategies import DDPStrategy, Strategy
from lightning.pytorch.utilities.exceptions import SIGTERMException
from torch.utils.data import DataLoader, Sampler, TensorDataset

from lightning_gradcomp import GradCompStrategy, LocalSGDStrategy, SwarmStrategy
from lightning_gradcomp.bench.runner import free_port
from lightning_gradcomp.callbacks import LGreCo
from lightning_gradcomp.compressors import (CLTK, DIANA, QSGD, Cast, Compressor, PowerSGD, RandomK, SignSGD,
                                            TernGrad, TopK)

TESTS_DIR = Path(__file__).resolve().parents[1]
if str(TESTS_DIR) not in sys.path:
    sys.path.insert(0, str(TESTS_DIR))

from helpers.models import TinyNet  # noqa: E402
from helpers.trees import tensors  # noqa: E402 - re-exported for the reliability tests

MARKER_ENV = "GRADCOMP_RELIABILITY_RUN"
"""Environment variable carrying a per-launch token: any process holding it belongs to that launch."""
STACK_AFTER_S = 90.0
"""A rank still running after this long writes every thread's stack to ``stack<r>.txt`` (:func:`run` waits 120 s);
``config["stack_after"]`` overrides it."""

STATEFUL = ("topk", "cltk", "powersgd", "diana", "signsgd", "lgreco", "swarm")
"""Cases whose checkpoints carry per-rank state that resume must restore exactly."""


# ---------------------------------------------------------------------------------------------- cases
def build_case(case: str, *, timeout: Optional[float] = None, nonfinite: str = "dense") -> Strategy:
    """The strategy of ``case``: ``"ddp"``, ``"swarm"``, ``"localsgd"``, a compressor name below, or ``"lgreco"`` (PowerSGD with
    L-GreCo choosing per-layer ranks at steps 4, 7, 10...). ``timeout`` in seconds."""
    extra: dict[str, Any] = {} if timeout is None else {"timeout": timedelta(seconds=timeout)}
    if case == "ddp":
        return DDPStrategy(**extra)
    if case == "swarm":
        return SwarmStrategy(local_steps=2, bits=8, mode="lockstep", **extra)  # exact restart needs lock-step
    if case == "localsgd":
        return LocalSGDStrategy(local_steps=2, compressor=CLTK(0.05), **extra)  # DiLoCo with CLT-k and its memory
    compressors: dict[str, Callable[[], Compressor]] = {
        "topk": lambda: TopK(0.05),
        "randomk": lambda: RandomK(0.1),
        "cltk": lambda: CLTK(0.05),
        "powersgd": lambda: PowerSGD(rank=2),
        "lgreco": lambda: PowerSGD(rank=2),
        "diana": lambda: DIANA(quantizer="linf:64"),
        "signsgd": lambda: SignSGD(bucket_size=128, aggregation="alltoall"),  # with its server memory at W = 2
        "qsgd": lambda: QSGD(bits=4, bucket_size=128),
        "terngrad": lambda: TernGrad(bucket_size=128),
        "fp16": lambda: Cast(torch.float16),  # no flag collective: the decision is made on the result
        "bf16": lambda: Cast(torch.bfloat16),
    }
    layerwise = LGreCo(period=3, warmup_steps=4, accumulate_steps=2, alpha=1.3) if case == "lgreco" else None
    return GradCompStrategy(compressor=compressors[case](), nonfinite=nonfinite, layerwise=layerwise, **extra)


# ---------------------------------------------------------------------------------------------- the rank
def rank_main(config: dict[str, Any], rank: int) -> None:
    """Run one rank of the fit described by ``config`` (environment variables already set)."""
    torch.set_num_threads(1)
    out = Path(config["out"])
    out.mkdir(parents=True, exist_ok=True)
    stacks = open(out / f"stack{rank}.txt", "w")  # noqa: SIM115 - open until the process exits
    faulthandler.dump_traceback_later(config.get("stack_after", STACK_AFTER_S), file=stacks)  # where a hung rank is
    caught: list[str] = []
    try:
        with warnings.catch_warnings(record=True) as records:
            warnings.simplefilter("always")
            try:
                _fit(config, rank, out)
            finally:
                caught = [str(w.message) for w in records]
    except SIGTERMException:  # Lightning ends training on SIGTERM: the script exits as a bare SystemExit would
        (out / f"sigterm{rank}").write_text(str(os.getpid()))
        raise SystemExit(0) from None
    except BaseException as err:  # noqa: BLE001 - record why this rank stopped, then exit non-zero
        (out / f"error{rank}.txt").write_text(f"{type(err).__name__}: {err}\n\n{traceback.format_exc()}")
        traceback.print_exc()  # what a user would see on this rank's stderr
        raise SystemExit(1) from None
    finally:
        (out / f"warnings{rank}.txt").write_text("\n".join(caught))


def _fit(config: dict[str, Any], rank: int, out: Path) -> None:
    strategy = build_case(config["case"], timeout=config.get("timeout"), nonfinite=config.get("nonfinite", "dense"))
    callbacks: list[pl.Callback] = [Probe(out, rank, config)]
    script = config.get("batches")  # the samples of every batch of this rank, instead of Lightning's sampler
    saving = bool(config.get("ckpt_dir")) and not config.get("last_only")  # last_only: Probe saves last.ckpt
    if saving:
        callbacks.append(ModelCheckpoint(dirpath=config["ckpt_dir"], save_top_k=-1, every_n_epochs=1,
                                         save_last=True))
    trainer = pl.Trainer(accelerator="cpu", devices=config["world"], num_nodes=1, strategy=strategy,
                         max_epochs=config["max_epochs"], logger=False, enable_progress_bar=False,
                         enable_model_summary=False, enable_checkpointing=saving,
                         callbacks=callbacks, default_root_dir=config.get("root_dir", str(out)),
                         use_distributed_sampler=script is None)
    model = TinyNet() if script is None else ScriptedNet(script[rank], config["steps_per_epoch"])
    trainer.fit(model, ckpt_path=config.get("ckpt_path"))


class ScriptedSampler(Sampler[int]):
    """Yields, in epoch ``e`` (``set_epoch``, as Lightning calls it), the samples of steps ``e * per_epoch`` to
    ``(e + 1) * per_epoch - 1`` of ``batches``, one step's samples after the other."""

    def __init__(self, batches: list[list[int]], per_epoch: int) -> None:
        self.batches, self.per_epoch, self.epoch = batches, per_epoch, 0

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    def _epoch(self) -> list[list[int]]:
        return self.batches[self.epoch * self.per_epoch:(self.epoch + 1) * self.per_epoch]

    def __iter__(self) -> Iterator[int]:
        return iter([i for batch in self._epoch() for i in batch])

    def __len__(self) -> int:
        return sum(len(batch) for batch in self._epoch())


class ScriptedNet(TinyNet):
    """``TinyNet`` trained on the batches given (``batches``: every step's sample ids, ``per_epoch`` steps an
    epoch), in place of those of Lightning's distributed sampler."""

    def __init__(self, batches: list[list[int]], per_epoch: int) -> None:
        super().__init__()
        self.script = ScriptedSampler(batches, per_epoch)

    def train_dataloader(self) -> DataLoader:
        return DataLoader(TensorDataset(self.x, self.y), batch_size=self.hparams.batch_size, sampler=self.script)


class Probe(pl.Callback):
    """Records one rank: losses as they happen, snapshots at train start and end; installs pause/injection."""

    def __init__(self, out: Path, rank: int, config: dict[str, Any]) -> None:
        self.out, self.rank, self.config = out, rank, config
        self.losses = open(out / f"losses{rank}.jsonl", "a", buffering=1)  # noqa: SIM115 - line-buffered log

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        torch.save(_snapshot(trainer, pl_module), self.out / f"start{self.rank}.pt")
        pause, inject = self.config.get("pause"), self.config.get("inject")
        if pause and pause["rank"] == self.rank:
            _install_pause(trainer, pl_module, pause, self.out / f"paused{self.rank}")
        if inject and inject["rank"] == self.rank:
            _install_injection(trainer, pl_module, inject)

    def on_train_batch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any,
                             batch_idx: int) -> None:
        fill = self.config.get("fill")
        if fill and trainer.global_step == fill["step"]:
            self.filled = True
            if fill["rank"] == self.rank:
                fill_disk(Path(self.config["ckpt_dir"]))

    def on_save_checkpoint(self, trainer: pl.Trainer, pl_module: pl.LightningModule,
                           checkpoint: dict[str, Any]) -> None:
        if getattr(self, "filled", False):  # the checkpoint grew (a callback's state, say) since the last save
            checkpoint["ballast"] = torch.zeros(64 * 1024)

    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any,
                           batch_idx: int) -> None:
        finite = bool(_flat_params(pl_module).isfinite().all())
        self.losses.write(json.dumps({"step": trainer.global_step, "loss": float(outputs["loss"]),
                                      "finite": finite, "samples": _sample_ids(pl_module, batch)}) + "\n")
        preempt = self.config.get("preempt")
        if preempt and trainer.global_step == preempt["step"]:
            torch.save(_snapshot(trainer, pl_module), self.out / f"preempted{self.rank}.pt")
            preempted(trainer)

    def on_train_epoch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if self.config.get("last_only"):  # every epoch over the same file, as save_last does
            trainer.save_checkpoint(Path(self.config["ckpt_dir"]) / "last.ckpt")

    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        torch.save(_snapshot(trainer, pl_module), self.out / f"end{self.rank}.pt")


def preempted(trainer: pl.Trainer) -> None:
    """What SLURM does to this rank near the time limit (``--signal=SIGUSR1@90``), then after ``scontrol requeue``:
    the requeue signal (Lightning saves ``hpc_ckpt_<n>.ckpt``, rank 0 requeues), then SIGTERM (Lightning stops).
    Both are handled before ``os.kill`` returns (Python runs the handler at once in the main thread)."""
    env = trainer._accelerator_connector.cluster_environment
    os.kill(os.getpid(), getattr(env, "requeue_signal", None) or signal.SIGUSR1)
    os.kill(os.getpid(), signal.SIGTERM)


def fill_disk(ckpt_dir: Path, page: int = 4096) -> None:
    """Fill ``ckpt_dir``'s file system so that the next save of ``last.ckpt`` finds room for its shards (a new file
    each, whole pages) and a quarter of the checkpoint file, not for the file (grown by 256 KiB of ballast)."""
    pages = [-(-f.stat().st_size // page) + 1 for f in (ckpt_dir / "last.ckpt.gradcomp").iterdir()]
    keep = sum(pages) * page + (ckpt_dir / "last.ckpt").stat().st_size // 4
    disk = os.statvfs(ckpt_dir)
    with open(ckpt_dir / "filler", "wb") as file:
        file.write(bytes(max(0, disk.f_bavail * disk.f_frsize - keep)))


def _sample_ids(module: Any, batch: Any) -> list[int]:
    """Which samples of ``TinyNet``'s data a batch holds, in order (its inputs are distinct random rows)."""
    x = getattr(module, "x", None)
    if not isinstance(x, torch.Tensor) or x.dim() != 2 or not isinstance(batch, (list, tuple)):
        return []
    return (batch[0][:, None, :] == x[None]).all(-1).int().argmax(1).tolist()


def _flat_params(module: Any) -> torch.Tensor:
    return torch.cat([p.detach().reshape(-1).clone() for p in module.parameters()])


def _snapshot(trainer: Any, module: Any) -> dict[str, Any]:
    """What the tests compare: parameters, global step, and the strategy's per-rank state."""
    strategy = trainer.strategy
    snap: dict[str, Any] = {"global_step": trainer.global_step, "params": _flat_params(module)}
    hook = getattr(strategy, "hook", None)
    if hook is not None:
        snap["hook"] = hook.rank_state() if hasattr(hook, "rank_state") else hook.state_dict()  # LocalSGD's engine
    if hasattr(strategy, "swarm_stats"):
        snap["round_index"] = strategy.round_index
        snap["swarm_stats"] = strategy.swarm_stats.state_dict()
    return snap


def _install_pause(trainer: Any, module: Any, pause: dict[str, Any], marker: Path) -> None:
    """Stop this rank mid-step at ``pause["step"]`` and announce it in ``marker``."""

    def stall() -> None:
        marker.write_text(str(os.getpid()))
        time.sleep(pause.get("seconds", 600))

    hook = getattr(trainer.strategy, "hook", None)
    if hook is not None and not pause.get("backward"):  # inside the compression hook, after the compressor issued its collectives

        class Stall:
            def wants(self, step: int) -> bool:
                return step == pause["step"]

            def __call__(self, record: Any) -> None:
                stall()

        hook.observers.append(Stall())
        return

    def grad_hook(grad: Any) -> Any:  # no compression hook (SwarmSGD): in the middle of backward
        if trainer.global_step == pause["step"]:
            stall()
        return grad

    module.body[2].weight.register_hook(grad_hook)


def _install_injection(trainer: Any, module: Any, inject: dict[str, Any]) -> None:
    """Put ``inject["value"]`` into this rank's gradient of ``body.2.weight`` at step ``inject["step"]``."""
    value = float(inject["value"])

    def grad_hook(grad: Any) -> Any:
        if trainer.global_step != inject["step"]:
            return grad
        return grad.index_fill(0, torch.tensor([0], device=grad.device), value)

    module.body[2].weight.register_hook(grad_hook)


# ---------------------------------------------------------------------------------------------- launching


SLURM_JOB_ID = "4242"

TORCHRUN_VARIABLES = ("MASTER_ADDR", "WORLD_SIZE", "LOCAL_RANK", "NODE_RANK", "RANK", "GROUP_RANK",
                      "LOCAL_WORLD_SIZE")


def _rank_env(config: dict[str, Any], rank: int, port: int) -> dict[str, Optional[str]]:
    """Rank ``rank``'s variables (``None``: unset): torchrun's, or (``config["slurm"]``) what ``srun`` sets for one
    task of a one-node job with ``--ntasks-per-node=W``, with ``scontrol`` on ``PATH`` a recorder
    (:func:`fake_scontrol`) and ``MASTER_ADDR`` left for ``SLURMEnvironment`` to derive from the node list."""
    world = str(config["world"])
    if not config.get("slurm"):
        return {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "WORLD_SIZE": world, "LOCAL_RANK": str(rank),
                "NODE_RANK": "0"}
    env: dict[str, Optional[str]] = dict.fromkeys(TORCHRUN_VARIABLES)
    bin_dir = fake_scontrol(Path(config["out"]))
    env.update(SLURM_JOB_ID=SLURM_JOB_ID, SLURM_JOB_NAME="gradcomp-preemption", SLURM_NTASKS=world,
               SLURM_NTASKS_PER_NODE=world, SLURM_NNODES="1", SLURM_JOB_NUM_NODES="1", SLURM_PROCID=str(rank),
               SLURM_LOCALID=str(rank), SLURM_NODEID="0", SLURM_NODELIST="127.0.0.1", MASTER_PORT=str(port),
               PATH=f"{bin_dir}{os.pathsep}{os.environ.get('PATH', '')}")
    return env


def fake_scontrol(out: Path) -> Path:
    """A folder holding an ``scontrol`` that appends ``<SLURM_PROCID> <arguments>`` to ``out/scontrol.log``."""
    bin_dir = out / "bin"
    bin_dir.mkdir(parents=True, exist_ok=True)
    script = bin_dir / "scontrol"
    script.write_text(f'#!/bin/sh\nprintf \'%s %s\\n\' "$SLURM_PROCID" "$*" >> \'{out / "scontrol.log"}\'\n')
    script.chmod(0o755)
    return bin_dir


def _apply(environ: Any, env: dict[str, Optional[str]]) -> None:
    for key, value in env.items():
        if value is None:
            environ.pop(key, None)
        else:
            environ[key] = value


def _fork_entry(config: dict[str, Any], rank: int, env: dict[str, Optional[str]], parent_env: dict[str, str]) -> None:
    os.environ.clear()  # the launching process's variables now (a forkserver holds those of when it started)
    os.environ.update(parent_env)
    _apply(os.environ, env)
    rank_main(config, rank)


@dataclass
class Ranks:
    """Handles on the W rank processes of one launch (``Popen`` or ``multiprocessing.Process``)."""

    procs: list[Any]
    mode: str
    out: Path
    marker: str
    logs: list[Any] = field(default_factory=list)

    @property
    def pids(self) -> list[int]:
        """Process ids by rank."""
        return [p.pid for p in self.procs]

    def exitcode(self, rank: int) -> Optional[int]:
        """Exit code of ``rank`` (negative: killed by that signal), ``None`` while it runs."""
        proc = self.procs[rank]
        return proc.poll() if self.mode == "subprocess" else proc.exitcode

    def signal(self, rank: int, sig: int) -> None:
        """Send ``sig`` to one rank."""
        os.kill(self.procs[rank].pid, sig)

    def wait(self, rank: int, timeout: float) -> Optional[int]:
        """Wait up to ``timeout`` seconds for ``rank`` to exit; its exit code, or ``None`` if still running."""
        proc = self.procs[rank]
        if self.mode == "subprocess":
            try:
                return proc.wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                return None
        proc.join(timeout)
        return proc.exitcode

    def wait_all(self, timeout: float) -> list[Optional[int]]:
        """Wait for every rank (``timeout`` seconds in total)."""
        deadline = time.monotonic() + timeout
        return [self.wait(r, max(0.0, deadline - time.monotonic())) for r in range(len(self.procs))]

    def wait_for_file(self, path: Path, timeout: float) -> bool:
        """Poll until ``path`` exists; False on timeout or when a rank exited first."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if path.exists():
                return True
            if any(self.exitcode(r) is not None for r in range(len(self.procs))):
                return path.exists()
            time.sleep(0.05)
        return False

    def stderr(self, rank: int) -> str:
        """A subprocess rank's captured stderr."""
        path = self.out / f"stderr{rank}.txt"
        return path.read_text(errors="replace") if path.exists() else ""

    def running(self) -> list[int]:
        """Pids of the ranks not yet exited (exited ranks are reaped here, so their pids are never reused)."""
        return [proc.pid for rank, proc in enumerate(self.procs) if self.exitcode(rank) is None]

    def leftovers(self) -> list[int]:
        """Processes of this launch still there: running ranks, their children, anything holding the marker."""
        return leftovers(self.marker, self.running())

    def cleanup(self) -> None:
        """SIGKILL what is left of this launch (only processes it started), then reap the ranks."""
        for pid in self.leftovers():
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        self.wait_all(10.0)
        for log in self.logs:
            log.close()

    def __enter__(self) -> "Ranks":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.cleanup()


def _context(mode: str) -> Any:
    """The multiprocessing context of ``mode``; the forkserver imports torch, Lightning and the package once.

    (Python 3.10-3.12's forkserver imports its preload list before it sets ``sys.path``, so it can only preload
    installed modules, not this one; each child imports this module itself, which is quick.)
    """
    import multiprocessing as mp

    context = mp.get_context(mode)
    if mode == "forkserver":
        context.set_forkserver_preload(["torch", "torch.distributed", "lightning.pytorch", "lightning_gradcomp"])
    return context


def launch(config: dict[str, Any], mode: str = "forkserver") -> Ranks:
    """Start ``config["world"]`` independent rank processes running :func:`rank_main`."""
    out = Path(config["out"])
    out.mkdir(parents=True, exist_ok=True)
    marker = f"{os.getpid()}-{time.monotonic_ns()}"
    port = free_port()
    procs: list[Any] = []
    logs: list[Any] = []
    config_path = out / "config.json"
    config_path.write_text(json.dumps(config))
    for rank in range(config["world"]):
        env = {**_rank_env(config, rank, port), MARKER_ENV: marker}
        if mode == "subprocess":
            full_env = {k: v for k, v in os.environ.items() if k not in ("RANK", "GROUP_RANK", "LOCAL_WORLD_SIZE")}
            _apply(full_env, env)
            full_env.update(PYTHONPATH=os.pathsep.join(filter(None, [str(TESTS_DIR),
                                                                          os.environ.get("PYTHONPATH")])))
            stdout = open(out / f"stdout{rank}.txt", "w")  # noqa: SIM115 - closed in Ranks.cleanup
            stderr = open(out / f"stderr{rank}.txt", "w")  # noqa: SIM115
            logs += [stdout, stderr]
            procs.append(subprocess.Popen([sys.executable, str(Path(__file__).resolve()), str(config_path),
                                           str(rank)], env=full_env, stdout=stdout, stderr=stderr,
                                          stdin=subprocess.DEVNULL))
        elif mode in ("fork", "forkserver"):
            proc = _context(mode).Process(target=_fork_entry, args=(config, rank, env, dict(os.environ)),
                                          daemon=False)
            proc.start()
            procs.append(proc)
        else:
            raise ValueError(f"mode must be 'forkserver', 'fork' or 'subprocess', got {mode!r}")
    return Ranks(procs, mode, out, marker, logs)


def run(config: dict[str, Any], timeout: float = 120.0) -> list[Optional[int]]:
    """Launch (forkserver), wait for every rank and clean up; the exit codes by rank."""
    with launch(config) as ranks:
        return ranks.wait_all(timeout)


# ---------------------------------------------------------------------------------------------- /proc
def leftovers(marker: str, pids: list[int]) -> list[int]:
    """Processes in ``/proc`` that are in ``pids`` (live processes we started), children of them, or hold
    ``marker`` in their environment (set at ``exec``, so inherited by anything a subprocess rank starts)."""
    found = []
    needle = f"{MARKER_ENV}={marker}".encode()
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit() or int(entry.name) == os.getpid():
            continue
        pid = int(entry.name)
        try:
            stat = (entry / "stat").read_text()
            ppid = int(stat.rsplit(")", 1)[1].split()[1])
            environ = (entry / "environ").read_bytes()
        except (OSError, ValueError, IndexError):
            continue  # exited meanwhile, or not ours to read
        if pid in pids or ppid in pids or needle in environ.split(b"\0"):
            found.append(pid)
    return found


# ---------------------------------------------------------------------------------------------- results
def losses(out: Path, rank: int) -> list[dict[str, Any]]:
    """The per-batch records ``{"step", "loss", "finite"}`` of one rank (complete lines only)."""
    path = Path(out) / f"losses{rank}.jsonl"
    if not path.exists():
        return []
    lines = path.read_text().splitlines()
    return [json.loads(line) for line in lines if line.endswith("}")]


def load(out: Path, name: str, rank: int) -> dict[str, Any]:
    """``start``/``end`` snapshot of one rank (``weights_only``)."""
    return torch.load(Path(out) / f"{name}{rank}.pt", weights_only=True)


def text(out: Path, name: str, rank: int) -> str:
    """``error``/``warnings`` text of one rank ('' if absent)."""
    path = Path(out) / f"{name}{rank}.txt"
    return path.read_text(errors="replace") if path.exists() else ""


if __name__ == "__main__":
    rank_main(json.loads(Path(sys.argv[1]).read_text()), int(sys.argv[2]))

"""A one-node SLURM cluster on this machine, for trying the cluster entry points and for the tests.

    python slurm/local_cluster.py start /tmp/nats-slurm     # prints the line that points sbatch & co. at it
    export SLURM_CONF=/tmp/nats-slurm/slurm.conf PATH=/tmp/nats-slurm/bin:$PATH
    sbatch ... / nats-train -m hydra/launcher=submitit_slurm ... / python slurm/pipeline.py ...
    python slurm/local_cluster.py stop /tmp/nats-slurm      # stops the daemons it started (by pid)

What it does (as root on Debian/Ubuntu): installs ``slurmd``, ``slurmctld`` and ``munge`` with apt-get when they
are missing; writes a ``slurm.conf`` for this machine (one node with its CPUs and memory as ``slurmd -C`` reports
them, one partition ``local``, free ports, ``proctrack/linuxproc``, ``task/none``, no accounting database) and a
munge key into the folder; starts ``munged``, ``slurmctld`` and ``slurmd`` in the foreground of their own
process groups, with every state, spool, socket and log file inside the folder; waits until the node is idle.
Nothing outside the folder is written, nothing already running (a system munged or slurmd) is touched.

Job states without an accounting database: the ``sacct`` in ``<folder>/bin`` (first on ``PATH`` in
:meth:`LocalCluster.env`) answers from the cluster's job-completion log (``JobCompType=jobcomp/filetxt``; array
tasks as ``<array>_<task>``) and from ``squeue`` for the jobs that have not ended: submitit asks
``sacct -o JobID,State,NodeList --parsable2 -j <id>`` for the state of its jobs (a job that ends without a result
is seen as FAILED instead of waited for). A requeued job starts again after ``cred_expire`` (5 s here; SLURM's
default is 120 s).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

PACKAGES = ("slurmd", "slurmctld", "munge")
DAEMONS = ("munged", "slurmctld", "slurmd")
SBIN = ("/usr/sbin", "/usr/bin", "/sbin", "/bin")
PARTITION = "local"


class Unavailable(RuntimeError):
    """This machine cannot run the local cluster (not root, no apt-get, the packages do not install)."""


def which(name: str) -> str | None:
    path = os.pathsep.join([os.environ.get("PATH", ""), *SBIN])
    return shutil.which(name, path=path)


def ensure_packages(log=print) -> None:
    """Installs slurmd, slurmctld and munge with apt-get when one of their programs is missing."""
    needed = ("slurmd", "slurmctld", "munged", "sbatch", "squeue", "scontrol", "sacct", "srun")
    missing = [p for p in needed if which(p) is None]
    if not missing:
        return
    if os.geteuid() != 0:
        raise Unavailable(f"{', '.join(missing)} not installed and not root (apt-get install {' '.join(PACKAGES)})")
    if shutil.which("apt-get") is None:
        raise Unavailable(f"{', '.join(missing)} not installed and no apt-get to install {' '.join(PACKAGES)}")
    env = dict(os.environ, DEBIAN_FRONTEND="noninteractive")
    log(f"local cluster: installing {' '.join(PACKAGES)} with apt-get ...")
    for cmd in (["apt-get", "update", "-q"], ["apt-get", "install", "-y", "-q", *PACKAGES]):
        res = subprocess.run(cmd, env=env, capture_output=True, text=True)
        if res.returncode != 0:
            raise Unavailable(f"{' '.join(cmd)} failed: {(res.stderr or res.stdout).strip()[-500:]}")
    missing = [p for p in needed if which(p) is None]
    if missing:
        raise Unavailable(f"{', '.join(missing)} still missing after apt-get install {' '.join(PACKAGES)}")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def node_line() -> dict[str, str]:
    """This machine as ``slurmd -C`` describes it (NodeName, CPUs, Boards, ..., RealMemory)."""
    out = subprocess.run([which("slurmd"), "-C"], capture_output=True, text=True, check=True).stdout
    first = out.splitlines()[0]
    return dict(kv.split("=", 1) for kv in first.split())


SACCT = """#!/bin/sh
# sacct for a cluster without an accounting database: the ended jobs from the job-completion log, the others from
# squeue, in sacct's --parsable2 form (what submitit asks: sacct -o JobID,State,NodeList --parsable2 -j <id> ...)
exec "{python}" "{module}" sacct --jobcomp "{jobcomp}" "$@"
"""


def sacct(argv: list[str]) -> int:
    """``sacct -o JobID,State,NodeList --parsable2 -j <id> ...`` answered without accounting storage: the ended
    jobs from the job-completion log (``jobcomp/filetxt``, one line per ended run of a job, array tasks as
    ``<array id>_<task>``), the queued and running ones from ``squeue`` (which wins for a requeued job)."""
    ap = argparse.ArgumentParser(prog="sacct")
    ap.add_argument("--jobcomp", required=True)
    ap.add_argument("-o", "--format", default="JobID,State,NodeList")
    ap.add_argument("-j", "--jobs", action="append", default=[])
    ap.add_argument("-P", "--parsable2", action="store_true")
    ap.add_argument("-n", "--noheader", action="store_true")
    args, _ = ap.parse_known_args(argv)
    fields = args.format.split(",")
    ids = {j for arg in args.jobs for j in arg.split(",")}
    rows: dict[str, dict[str, str]] = {}

    def add(job_id: str, state: str, nodes: str) -> None:
        rows[job_id] = {"JobID": job_id, "JobIDRaw": job_id, "State": state, "NodeList": nodes}

    log = Path(args.jobcomp)
    for line in log.read_text(errors="replace").splitlines() if log.is_file() else []:
        kv = dict(re.findall(r"(\w+)=(\S*)", line))
        if "JobId" not in kv:
            continue
        array = kv.get("ArrayJobId")
        job_id = f"{array}_{kv.get('ArrayTaskId')}" if array and array != "0" else kv["JobId"]
        add(job_id, kv.get("JobState", ""), kv.get("NodeList", ""))
    squeue = which("squeue") or "squeue"
    res = subprocess.run([squeue, "-h", "-r", "-o", "%i|%T|%N"], capture_output=True, text=True)
    for line in res.stdout.splitlines():
        job_id, state, nodes = (line.split("|") + ["", "", ""])[:3]
        add(job_id, state, nodes)
    if ids:
        rows = {k: v for k, v in rows.items() if k in ids or k.split("_")[0] in ids}
    if not args.noheader:
        print("|".join(fields))
    for row in rows.values():
        print("|".join(row.get(f, "") for f in fields))
    return 0


class LocalCluster:
    """The daemons of a one-node cluster whose files all live in ``folder``."""

    def __init__(self, folder: str | os.PathLike, log=print):
        self.folder = Path(folder).resolve()
        self.conf = self.folder / "slurm.conf"
        self.bin = self.folder / "bin"
        self.pids_file = self.folder / "pids.json"
        self.log = log
        self.procs: dict[str, subprocess.Popen] = {}

    # ------------------------------------------------------------------------------------------------
    def env(self, base: dict[str, str] | None = None) -> dict[str, str]:
        """``base`` (default: this process's environment) pointed at the cluster: ``SLURM_CONF`` and ``PATH``."""
        env = dict(os.environ if base is None else base)
        env["SLURM_CONF"] = str(self.conf)
        env["PATH"] = os.pathsep.join([str(self.bin), env.get("PATH", "")])
        for key in [k for k in env if k.startswith(("SLURM_", "SBATCH_", "SALLOC_", "SRUN_")) and k != "SLURM_CONF"]:
            del env[key]  # nothing of an enclosing job
        return env

    def write_config(self) -> None:
        node = node_line()
        name = socket.gethostname().split(".")[0]
        mem = int(node.get("RealMemory", "1000"))
        mem = max(100, mem - min(1024, mem // 10))  # at most what slurmd finds, or it drains the node
        for sub in ("state", "spool", "munge", "log", "bin"):
            (self.folder / sub).mkdir(parents=True, exist_ok=True)
        os.chmod(self.folder / "munge", 0o755)
        key = self.folder / "munge" / "munge.key"
        if not key.exists():
            key.write_bytes(os.urandom(1024))
            os.chmod(key, 0o600)
        f = self.folder
        node_hw = " ".join(
            f"{k}={node[k]}"
            for k in ("CPUs", "Boards", "SocketsPerBoard", "CoresPerSocket", "ThreadsPerCore")
            if k in node
        )
        self.conf.write_text(
            f"""# a one-node cluster on this machine (slurm/local_cluster.py); every file under {f}
ClusterName=natslocal
SlurmctldHost={name}(127.0.0.1)
SlurmctldPort={free_port()}
SlurmdPort={free_port()}
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
CredType=cred/munge
AuthInfo=socket={f}/munge/munge.socket,cred_expire=5
StateSaveLocation={f}/state
SlurmdSpoolDir={f}/spool
SlurmctldPidFile={f}/slurmctld.pid
SlurmdPidFile={f}/slurmd.pid
SlurmctldLogFile={f}/log/slurmctld.log
SlurmdLogFile={f}/log/slurmd.log
SlurmctldDebug=info
SlurmdDebug=info
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
MpiDefault=none
SwitchType=switch/none
ReturnToService=2
SchedulerType=sched/backfill
SchedulerParameters=sched_interval=2
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
JobCompType=jobcomp/filetxt
JobCompLoc={f}/log/jobcomp.txt
PlugStackConfig={f}/plugstack.conf
KillWait=10
MailProg=/bin/true
MinJobAge=300
InactiveLimit=0
NodeName={name} NodeAddr=127.0.0.1 {node_hw} RealMemory={mem} State=UNKNOWN
PartitionName={PARTITION} Nodes={name} Default=YES MaxTime=INFINITE State=UP OverSubscribe=FORCE:4
"""
        )
        (f / "plugstack.conf").write_text("")
        sacct_shim = self.bin / "sacct"
        sacct_shim.write_text(
            SACCT.format(python=sys.executable, module=Path(__file__).resolve(), jobcomp=f / "log" / "jobcomp.txt")
        )
        sacct_shim.chmod(0o755)

    # ------------------------------------------------------------------------------------------------
    def _spawn(self, name: str, cmd: list[str]) -> None:
        out = open(self.folder / "log" / f"{name}.out", "ab")
        self.procs[name] = subprocess.Popen(
            cmd,
            stdout=out,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            start_new_session=True,
            env=self.env(),
            cwd=self.folder,
        )
        out.close()
        self.pids_file.write_text(json.dumps({k: p.pid for k, p in self.procs.items()}))

    def _check_alive(self) -> None:
        for name, p in self.procs.items():
            if p.poll() is not None:
                tail = (self.folder / "log" / f"{name}.out").read_text(errors="replace")[-2000:]
                logs = sorted((self.folder / "log").glob(f"{name}*.log"))
                if logs:
                    tail += logs[0].read_text(errors="replace")[-2000:]
                raise RuntimeError(f"{name} exited with status {p.returncode}:\n{tail}")

    def _wait(self, what: str, ok, timeout: float) -> None:
        t0 = time.time()
        while not ok():
            self._check_alive()
            if time.time() - t0 > timeout:
                raise RuntimeError(f"local cluster: {what} not after {timeout:.0f} s (logs in {self.folder / 'log'})")
            time.sleep(0.2)

    def _ok(self, cmd: list[str]) -> str | None:
        res = subprocess.run(cmd, env=self.env(), capture_output=True, text=True)
        return res.stdout if res.returncode == 0 else None

    def start(self, timeout: float = 60) -> LocalCluster:
        if not hasattr(os, "geteuid") or os.geteuid() != 0:
            raise Unavailable("not root (the cluster's daemons run as root, SlurmUser=root)")
        if not Path("/proc/self/cwd").exists():
            raise Unavailable("no /proc (the cluster tracks its processes through /proc)")
        ensure_packages(self.log)
        if self.running():
            raise RuntimeError(f"a local cluster already runs in {self.folder}: stop it first")
        self.folder.mkdir(parents=True, exist_ok=True)
        os.chmod(self.folder, 0o755)
        self.write_config()
        m = self.folder / "munge"
        try:
            self._spawn(
                "munged",
                [
                    which("munged"),
                    "--foreground",
                    "--force",
                    f"--socket={m}/munge.socket",
                    f"--key-file={m}/munge.key",
                    f"--pid-file={m}/munged.pid",
                    f"--log-file={m}/munged.log",
                    f"--seed-file={m}/munged.seed",
                ],
            )
            self._wait("munged", lambda: (m / "munge.socket").exists(), timeout)
            self._spawn("slurmctld", [which("slurmctld"), "-D", "-i", "-f", str(self.conf)])
            self._wait(
                "slurmctld",
                lambda: self._ok([which("scontrol"), "ping"]) and "UP" in self._ok([which("scontrol"), "ping"]),
                timeout,
            )
            self._spawn(
                "slurmd", [which("slurmd"), "-D", "-f", str(self.conf), "-N", socket.gethostname().split(".")[0]]
            )
            self._wait("the node idle", self.node_idle, timeout)
        except BaseException:
            self.stop()
            raise
        return self

    def running(self) -> dict[str, int]:
        """The daemons of ``pids.json`` that still run (a start in this folder from another process)."""
        pids = json.loads(self.pids_file.read_text()) if self.pids_file.is_file() else {}
        return {name: pid for name, pid in pids.items() if _is(pid, name)}

    def node_idle(self) -> bool:
        out = self._ok([which("sinfo"), "-h", "-N", "-o", "%T"])
        return bool(out) and out.split()[0].strip("*") == "idle"

    # ------------------------------------------------------------------------------------------------
    def cancel_all(self) -> None:
        if self.procs.get("slurmctld") and self.procs["slurmctld"].poll() is None:
            subprocess.run(
                [which("scancel"), "--full", "-u", "root" if os.geteuid() == 0 else os.environ.get("USER", "")],
                env=self.env(),
                capture_output=True,
            )
            self._wait_jobs_gone(30)

    def _wait_jobs_gone(self, timeout: float) -> None:
        t0 = time.time()
        while time.time() - t0 < timeout:
            out = self._ok([which("squeue"), "-h", "-o", "%i"])
            if out is not None and not out.strip():
                return
            time.sleep(0.5)

    def stop(self) -> None:
        """scancel every job, then SIGTERM (SIGKILL after 10 s) each daemon this object started, last first."""
        try:
            self.cancel_all()
        except Exception:
            pass
        for name in reversed(list(self.procs)):
            p = self.procs[name]
            if p.poll() is None:
                p.terminate()
                try:
                    p.wait(timeout=10)
                except subprocess.TimeoutExpired:
                    p.kill()
                    p.wait()
        self.procs.clear()
        kill_stepds(self.folder)
        self.pids_file.unlink(missing_ok=True)


def _is(pid: int, name: str) -> bool:
    """Whether process ``pid`` runs the program ``name`` (a pid from a file may be someone else's by now)."""
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")[0].decode().endswith(name)
    except OSError:
        return False


def kill_stepds(folder: Path) -> list[int]:
    """SIGKILL the ``slurmstepd`` processes left by the cluster in ``folder`` (a job step whose slurmd has gone
    waits for it forever); they are found by their working directory, the cluster's folder."""
    killed = []
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        try:
            if not (proc / "cmdline").read_bytes().startswith(b"slurmstepd"):
                continue
            cwd = os.readlink(proc / "cwd").removesuffix(" (deleted)")
        except OSError:
            continue
        if cwd == str(folder) or cwd.startswith(f"{folder}/"):
            os.kill(int(proc.name), signal.SIGKILL)
            killed.append(int(proc.name))
    return killed


def _stop_by_pid_file(folder: Path) -> None:
    """``stop`` from another process: scancel, then end the daemons named in ``<folder>/pids.json``."""
    cluster = LocalCluster(folder)
    pids = json.loads(cluster.pids_file.read_text()) if cluster.pids_file.is_file() else {}
    subprocess.run(
        [which("scancel"), "--full", "-u", "root" if os.geteuid() == 0 else os.environ.get("USER", "")],
        env=cluster.env(),
        capture_output=True,
    )
    cluster._wait_jobs_gone(30)
    for name in reversed(list(pids)):
        pid = pids[name]
        if not _is(pid, name):
            continue  # gone, or the pid is someone else's now
        os.kill(pid, signal.SIGTERM)
        for _ in range(100):
            if not Path(f"/proc/{pid}").exists():
                break
            time.sleep(0.1)
        else:
            os.kill(pid, signal.SIGKILL)
    kill_stepds(folder)
    cluster.pids_file.unlink(missing_ok=True)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["sacct"]:
        return sacct(argv[1:])
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("action", choices=("start", "stop"))
    ap.add_argument("folder", help="where the config, state, spool, sockets and logs go")
    args = ap.parse_args(argv)
    folder = Path(args.folder).resolve()
    if args.action == "stop":
        _stop_by_pid_file(folder)
        return 0
    try:
        cluster = LocalCluster(folder, log=lambda m: print(m, file=sys.stderr)).start()
    except (Unavailable, RuntimeError) as exc:  # cannot run here; already running; a daemon did not start
        print(f"local cluster: {exc}", file=sys.stderr)
        return 1
    for p in cluster.procs.values():  # the daemons outlive this command; `stop` ends them by pid
        p.returncode = 0
    print(f"export SLURM_CONF={cluster.conf} PATH={cluster.bin}:$PATH")
    print(f"# when done: python {__file__} stop {folder}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())

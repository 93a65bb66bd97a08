"""Hosts for real on one machine: Linux network namespaces on a bridge, each with its own address,
hostname (UTS namespace) and sshd, plus a launcher namespace to start jobs from.

    with NamespaceHosts(2) as hosts:         # hvt-<id>-h0, -h1 at 10.213.<k>.2, .3
        hosts.run([mpirun, "--hostfile", hosts.hostfile(slots=2), ...])

Everything lives in namespaces the fixture creates (the bridge too): the machine's own network
is untouched, and traffic goes only to loopback and to the fixture's own addresses. sshd runs
with a temporary host key and accepts only a temporary client key (root, key login); the
launcher sees a private ~/.ssh (a mount namespace) whose config names that key and keeps no
known_hosts, so mpirun, horovodrun and hvtrain launch use plain `ssh HOST` as on a cluster.
Torn down on exit: every process in the fixture's namespaces is killed, then the namespaces
(only those this instance created) are deleted.
"""

from __future__ import annotations

import os
import secrets
import shutil
import signal
import subprocess
import tempfile
import time
from pathlib import Path

REQUIRED = {"ip": "iproute2", "sshd": "openssh-server", "ssh": "openssh-client", "ssh-keygen": "openssh-client",
            "unshare": "util-linux", "mount": "mount"}


def missing() -> list[str]:
    """What this machine lacks for namespace hosts (empty: everything is there), probing that a
    network namespace can really be made (root in a container may lack CAP_NET_ADMIN)."""
    gone = [f"{tool} ({pkg})" for tool, pkg in REQUIRED.items()
            if not (shutil.which(tool) or Path(f"/usr/sbin/{tool}").exists())]
    if os.geteuid() != 0:
        return [*gone, "root (network namespaces need CAP_SYS_ADMIN and CAP_NET_ADMIN)"]
    if not gone:
        probe = f"hvtprobe{secrets.token_hex(3)}"
        made = subprocess.run(["ip", "netns", "add", probe], capture_output=True, text=True)
        if made.returncode != 0:
            gone.append(f"permission to create network namespaces ({made.stderr.strip()})")
        else:
            subprocess.run(["ip", "netns", "del", probe], capture_output=True)
    return gone


def _sh(*argv: str, check: bool = True) -> subprocess.CompletedProcess:
    proc = subprocess.run(list(argv), capture_output=True, text=True, timeout=60)
    if check and proc.returncode != 0:
        raise RuntimeError(f"{' '.join(argv)} failed ({proc.returncode}): {proc.stderr.strip()}")
    return proc


class NamespaceHosts:
    def __init__(self, count: int = 2, subnet: int = 213) -> None:
        self.count, self.tag = count, f"hvt{secrets.token_hex(3)}"  # never another run's namespaces
        self.net = f"10.{subnet}.{secrets.randbelow(250)}"
        self.names = [f"{self.tag}-h{i}" for i in range(count)]
        self.addresses = [f"{self.net}.{i + 2}" for i in range(count)]
        self.launcher_ns, self.bridge_ns = f"{self.tag}-l", f"{self.tag}-br"
        self.dir = Path(tempfile.mkdtemp(prefix="hvtrain-hosts-"))
        self.sshd: list[subprocess.Popen] = []
        self.created: list[str] = []  # namespaces this instance made (only these are deleted)

    # -- lifecycle -----------------------------------------------------------------------------
    def __enter__(self) -> NamespaceHosts:
        try:
            self._up()
        except BaseException:
            self.__exit__(None, None, None)
            raise
        return self

    def _up(self) -> None:
        d = self.dir
        _sh("ip", "netns", "add", self.bridge_ns)
        self.created.append(self.bridge_ns)
        _sh("ip", "-n", self.bridge_ns, "link", "add", "br0", "type", "bridge")
        _sh("ip", "-n", self.bridge_ns, "link", "set", "br0", "up")
        for k, (ns, addr) in enumerate([(self.launcher_ns, f"{self.net}.1"), *zip(self.names, self.addresses,
                                                                                  strict=True)]):
            _sh("ip", "netns", "add", ns)
            self.created.append(ns)
            _sh("ip", "link", "add", f"{self.tag}v{k}", "type", "veth", "peer", "name", "eth0", "netns", ns)
            _sh("ip", "link", "set", f"{self.tag}v{k}", "netns", self.bridge_ns)
            _sh("ip", "-n", self.bridge_ns, "link", "set", f"{self.tag}v{k}", "master", "br0", "up")
            _sh("ip", "-n", ns, "addr", "add", f"{addr}/24", "dev", "eth0")
            _sh("ip", "-n", ns, "link", "set", "eth0", "up")
            _sh("ip", "-n", ns, "link", "set", "lo", "up")
        _sh("ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", str(d / "id"))
        _sh("ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", str(d / "hostkey"))
        (d / "authorized_keys").write_text((d / "id.pub").read_text())
        dot_ssh = d / "ssh"
        dot_ssh.mkdir()
        (dot_ssh / "config").write_text(
            f"Host {self.net}.* {' '.join(self.names)}\n  IdentityFile {d / 'id'}\n  UserKnownHostsFile /dev/null\n"
            "  StrictHostKeyChecking no\n  BatchMode yes\n  LogLevel ERROR\n"
            # as a cluster's ssh config should: a vanished host ends its ssh session in ~20 s (Horovod
            # elastic's driver waits for that session before it re-forms the world without the host)
            "  ServerAliveInterval 5\n  ServerAliveCountMax 4\n")
        (dot_ssh / "config").chmod(0o600)
        hosts_file = "".join(f"{a} {n}\n" for a, n in zip(self.addresses, self.names, strict=True))
        (d / "hosts").write_text(f"127.0.0.1 localhost\n{hosts_file}")
        Path("/run/sshd").mkdir(exist_ok=True)  # sshd's privilege separation directory
        sshd = shutil.which("sshd") or "/usr/sbin/sshd"
        for ns, name, addr in zip(self.names, self.names, self.addresses, strict=True):
            # its own UTS namespace: each host has its own hostname (Gloo advertises it), and a
            # private /etc/hosts (a mount namespace) that resolves the fixture's host names
            cmd = (f"hostname {name} && mount --bind {d / 'hosts'} /etc/hosts && exec {sshd} -D -f /dev/null -h {d / 'hostkey'} -o ListenAddress={addr} "
                   f"-o PermitRootLogin=prohibit-password -o AuthorizedKeysFile={d / 'authorized_keys'} "
                   "-o StrictModes=no -o UsePAM=no -o PidFile=none -o AcceptEnv=*")
            self.sshd.append(subprocess.Popen(["ip", "netns", "exec", ns, "unshare", "--uts", "--mount",
                                               "--propagation", "private", "sh", "-c", cmd],
                                              stdout=subprocess.DEVNULL, stderr=subprocess.PIPE))
        deadline = time.time() + 30
        for addr in self.addresses:
            while self.launch(["ssh", addr, "true"], check=False, timeout=10).returncode != 0:
                if time.time() > deadline:
                    raise RuntimeError(f"sshd on {addr} did not accept the key in 30 s")
                time.sleep(0.2)

    def __exit__(self, *exc) -> None:
        for ns in self.created:  # sshd, its sessions, orted and ranks a timed-out test left behind
            pids = _sh("ip", "netns", "pids", ns, check=False).stdout.split()
            for pid in pids:
                try:
                    os.kill(int(pid), signal.SIGKILL)
                except (ProcessLookupError, ValueError):
                    pass
        for p in self.sshd:
            try:
                p.wait(10)
            except subprocess.TimeoutExpired:
                pass
        for ns in reversed(self.created):
            _sh("ip", "netns", "del", ns, check=False)  # removes its veth ends too
        shutil.rmtree(self.dir, ignore_errors=True)

    # -- use -----------------------------------------------------------------------------------
    def hostfile(self, slots: int, names: bool = False) -> Path:
        """An OpenMPI hostfile of the hosts' addresses (or names: resolved by the launcher's hosts)."""
        path = self.dir / f"hostfile-{slots}{'-names' if names else ''}"
        hosts = self.names if names else self.addresses
        path.write_text("".join(f"{h} slots={slots}\n" for h in hosts))
        return path

    def launch(self, argv: list[str], env: dict[str, str] | None = None, timeout: float = 600,
               check: bool = True, popen: bool = False, log: Path | None = None):
        """Run argv in the launcher namespace with the fixture's ~/.ssh and /etc/hosts (a private
        mount namespace: nothing changes for the rest of the machine; ~/.ssh is made empty first
        if the account has none, the one change outside the fixture's own files)."""
        dot_ssh = Path(os.path.expanduser("~root" if os.geteuid() == 0 else "~")) / ".ssh"
        dot_ssh.mkdir(mode=0o700, exist_ok=True)
        script = (f"mount --bind {self.dir / 'ssh'} {dot_ssh} && mount --bind {self.dir / 'hosts'} /etc/hosts && "
                  'exec "$@"')
        full = ["ip", "netns", "exec", self.launcher_ns, "unshare", "--mount", "--propagation", "private",
                "sh", "-c", script, "sh", *argv]
        if popen:  # started, not awaited; stdout and stderr go to `log` (a pipe nobody reads fills up)
            with open(log or os.devnull, "w") as out:
                return subprocess.Popen(full, env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
        proc = subprocess.run(full, env=env, capture_output=True, text=True, timeout=timeout)
        if check and proc.returncode != 0:
            raise AssertionError(f"{argv} exited {proc.returncode}\nstdout:\n{proc.stdout[-4000:]}\n"
                                 f"stderr:\n{proc.stderr[-4000:]}")
        return proc

    def link_down(self, index: int) -> None:
        """Cut host `index` off the bridge (as if its node vanished)."""
        _sh("ip", "-n", self.names[index], "link", "set", "eth0", "down")

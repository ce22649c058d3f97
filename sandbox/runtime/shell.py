"""The persistent-shell protocol spoken over one exec socket with a TTY.

Inside the container runs one interactive `bash --noediting` with job control (`set -m`): every foreground
pipeline gets its own process group and the TTY's foreground group, so Ctrl-C (a 0x03 byte written to the TTY)
interrupts exactly the running command, while builtins (`cd`, assignments, function definitions) run in the
shell itself and their state persists.

Host -> shell: the command text travels as `$'...'` assignments of printable ASCII, each line well under the
TTY's 4096-byte canonical line limit, then one line evaluates it:

    __t1_c=$'...'; __t1_c+=$'...'                       (chunks; every control byte escaped as \\xHH)
    T1_SANDBOX_CMD=<seq>; builtin eval -- "$__t1_c" </dev/null >&19 2>&1; __t1_done $? <token>

Shell -> host: the command's output, then a frame `\\x1e<token>:<payload>\\x1e\\n`. The token is random per
command and never stored in the shell (it is an argument on the evaluated line), so printing the shell's
variables or functions cannot forge a frame. Stdin is /dev/null: a command cannot eat the protocol's bytes.

Every child of a command inherits `T1_SANDBOX_CMD=<seq>` in its environment; `__t1_sweep` finds processes by
that marker (or by start time where another user's environment is unreadable) and stops then kills them, in
passes until none is left (a fork bomb refills between passes). It is pure bash (no fork), so it also works
when the pids limit is exhausted, and the same text runs from a separate `docker exec` when the shell is stuck.
"""

from __future__ import annotations

import os
import re
import select
import socket
import ssl
import subprocess
import time
from collections.abc import Callable
from typing import Protocol

# fd the shell keeps pointing at the TTY: commands that redirect fd 1 for good (`exec >log`) cannot swallow frames.
FRAME_FD = 19
MARKER_VAR = "T1_SANDBOX_CMD"
_LINE_BUDGET = 3000  # bytes per input line; the TTY drops whatever exceeds 4095 in canonical mode

# Shell functions, shared by the persistent shell and the out-of-band killer (`bash -c`).
SHELL_FUNCTIONS = r"""
__t1_frame() { builtin printf '\036%s:%s\036\n' "$1" "$2" >&19; }
__t1_done() { local rc=$1; __t1_c=; __t1_frame "$2" "$rc"; }
__t1_oom() {
  local k v f
  __t1_n=-1
  for f in /sys/fs/cgroup/memory/memory.oom_control /sys/fs/cgroup/memory.events; do
    [[ -r $f ]] || continue
    while read -r k v; do [[ $k == oom_kill ]] && __t1_n=$v; done < "$f"
    break
  done
}
__t1_sweep() {
  local - IFS=$' \t\n' want=$1 maxage=$2 up minstart=-1 end pass p pid kv hit rd st
  local -a f pids
  set +e +u +f
  read -r up _ < /proc/uptime; up=${up%.*}${up#*.}; up=$(( 10#$up ))
  (( maxage >= 0 )) && minstart=$(( up - maxage ))
  end=$(( up + 1000 ))  # centiseconds of uptime: unlike $SECONDS, the agent cannot reset or unset it
  for (( pass = 1; ; pass++ )); do  # syntax, not `while :`: an agent's fork bomb is often a function named `:`
    pids=()
    for p in /proc/[1-9]*; do
      pid=${p#/proc/}
      [[ " $__t1_keep $$ $BASHPID " == *" $pid "* ]] && continue
      read -r st 2>/dev/null < "$p/stat" || continue
      st=${st##*') '}; f=($st)
      [[ ${f[0]} == [ZX] ]] && continue  # dead already; its parent reaps it
      hit= rd=
      if [[ $want == all ]]; then hit=1
      else
        { rd=1; while IFS= read -r -d '' kv; do
            [[ $kv == "$__t1_var=$want" ]] && { hit=1; break; }
          done; } 2>/dev/null < "$p/environ"
        [[ -z $rd ]] && (( minstart >= 0 && f[19] >= minstart )) && hit=1
      fi
      [[ -n $hit ]] || continue
      pids+=("$pid")
      # From the second pass on, freeze before killing: a fork bomb refills the pids freed by each kill.
      (( pass > 1 )) && builtin kill -STOP "$pid" 2>/dev/null
    done
    (( ${#pids[@]} )) || return 0
    builtin kill -KILL "${pids[@]}" 2>/dev/null
    read -r up _ < /proc/uptime; up=${up%.*}${up#*.}
    # A SIGKILLed process stays visible (state R or D) until it gets a CPU to run its exit: on a loaded host
    # that outlasts many quick passes, so the limit is time (10 s), not a number of passes, and each pass
    # waits 10 ms without forking (a fresh pty master never has data to read).
    (( 10#$up < end )) || return 1
    builtin read -r -t 0.01 _ 2>/dev/null <>/dev/ptmx
  done
}
"""

# Runs once per shell, right after the exec starts; `{keep}` is the keepalive pid ('' on first start: found here
# as the only process whose parent is init, before anything else ran). The search retries for up to 2 s (10 ms
# apart, bash builtins only): one eval episode of a default run on the loaded 2-core box failed its start with
# "found []", most likely an exec that ran before init had forked the keepalive.
_INIT = r"""
exec 2>/dev/null {fd}>&1
stty -echo -onlcr cols 200 rows 50; __t1_tty=$?
PS1= PS2= PS0= PS4='+ '; unset PROMPT_COMMAND HISTFILE MAILCHECK TMOUT; set +o history +H -m
export {var}=0; __t1_var={var}; __t1_c=; __t1_keep='{keep}'
""".strip()
_FIND_KEEPALIVE = r"""
if [[ -z $__t1_keep ]]; then for __t1_i in {1..200}; do for __t1_p in /proc/[1-9]*/stat; do read -r __t1_s < "$__t1_p"; __t1_s=${__t1_s##*') '}; __t1_s=($__t1_s); [[ ${__t1_s[1]} == 1 && ${__t1_p:6:-5} != $$ ]] && __t1_keep="1 ${__t1_p:6:-5}" && break; done; [[ -n $__t1_keep ]] && break; builtin read -r -t 0.01 _ 2>/dev/null <>/dev/ptmx; done; unset __t1_p __t1_s __t1_i; fi
""".strip()


def init_script(token: str, *, keep: str) -> bytes:
    """Lines that turn a fresh interactive bash into the protocol's shell; ends with a `ready` frame that
    carries `<stty exit status> <shell pid> <oom_kill count> <pids never to kill: init, keepalive>`."""
    lines = [_INIT.format(fd=FRAME_FD, var=MARKER_VAR, keep=keep)]
    lines += [ln for ln in SHELL_FUNCTIONS.strip().splitlines()]
    lines.append(_FIND_KEEPALIVE)
    lines.append(f'__t1_oom; __t1_frame {token} "ready $__t1_tty $$ $__t1_n $__t1_keep"')
    return _join(lines)


def killer_script(*, keep: str, want: str, maxage_cs: int) -> str:
    """`bash -c` text for the out-of-band killer (a `docker exec`): the same sweep, from outside the shell."""
    return (f"{SHELL_FUNCTIONS}\nexec {FRAME_FD}>/dev/null\n__t1_var={MARKER_VAR}; __t1_keep='{keep}'\n"
            f"__t1_sweep {want} {maxage_cs}\n")


def _escape(data: bytes) -> str:
    # $'...' turns \xHH into that byte; printable ASCII passes through (save ' and \), so the TTY sees no
    # control byte (0x03 would be Ctrl-C, 0x04 EOF, 0x15 kill-line...).
    return "".join(chr(b) if 0x20 <= b < 0x7F and b not in (0x27, 0x5C) else f"\\x{b:02x}" for b in data)


def encode_command(command: bytes, *, seq: int, token: str) -> bytes:
    """Protocol lines that store `command` in the shell and evaluate it with marker `seq`, ending in a frame."""
    assert b"\x00" not in command, "NUL bytes cannot travel in a bash string; the caller rejects them"
    lines: list[str] = []
    step = _LINE_BUDGET // 4  # worst case every byte becomes \xHH
    pieces = [_escape(command[i:i + step]) for i in range(0, len(command), step)] or [""]
    # Coalesce short escaped pieces so typical commands take one line.
    merged: list[str] = []
    for piece in pieces:
        if merged and len(merged[-1]) + len(piece) <= _LINE_BUDGET:
            merged[-1] += piece
        else:
            merged.append(piece)
    run = (f"{MARKER_VAR}={seq}; builtin eval -- \"$__t1_c\" </dev/null >&{FRAME_FD} 2>&1; "
           f"__t1_done $? {token}")
    for i, piece in enumerate(merged):
        lines.append(f"__t1_c{'+' if i else ''}=$'{piece}'")
    if len(lines[-1]) + len(run) + 2 <= _LINE_BUDGET:
        lines[-1] = f"{lines[-1]}; {run}"
    else:
        lines.append(run)
    return _join(lines)


def control_line(text: str) -> bytes:
    assert len(text) < _LINE_BUDGET and "\n" not in text
    return _join([text])


def _join(lines: list[str]) -> bytes:
    for ln in lines:
        assert len(ln) < 4000, f"protocol line of {len(ln)} bytes would be cut by the TTY"
    return ("\n".join(lines) + "\n").encode("ascii")


class OutputCap:
    """Keeps the first and last `cap // 2` bytes of a stream and counts the rest: memory stays O(cap)."""

    def __init__(self, cap: int) -> None:
        self.head_cap = cap // 2
        self.tail_cap = cap - self.head_cap
        self.head = bytearray()
        self.tail = bytearray()
        self.total = 0

    def add(self, data: bytes) -> None:
        self.total += len(data)
        room = self.head_cap - len(self.head)
        if room > 0:
            self.head += data[:room]
            data = data[room:]
        if len(data) >= self.tail_cap:
            self.tail = bytearray(data[len(data) - self.tail_cap:])
        elif data:
            self.tail += data
            if len(self.tail) > 2 * self.tail_cap:  # trim in batches: amortised O(1) per byte
                del self.tail[:-self.tail_cap]

    @property
    def dropped(self) -> int:
        return max(0, self.total - self.head_cap - self.tail_cap)

    def text(self) -> str:
        if self.dropped == 0:  # nothing was trimmed: head and tail are the whole stream
            return clean_output(bytes(self.head) + bytes(self.tail))
        return (clean_output(bytes(self.head)) + f"\n[t1: {self.dropped} bytes of output omitted]\n"
                + clean_output(bytes(self.tail[-self.tail_cap:])))


# CSI (ESC [ ... final), OSC (ESC ] ... BEL | ESC \), other two-byte escapes (ESC + one of @-Z \ ] ^ _ and
# charset selections ESC ( B), and the 8-bit CSI.
_ANSI = re.compile(r"\x1b\[[0-?]*[ -/]*[@-~]|\x1b\][^\x07\x1b]*(?:\x07|\x1b\\)?|\x1b[()*+][0-9A-Za-z]|"
                   r"\x1b[@-Z\\^_=>78]|\x9b[0-?]*[ -/]*[@-~]")


def clean_output(raw: bytes) -> str:
    """UTF-8 (invalid bytes replaced), ANSI escape sequences removed, CRLF normalised to LF."""
    return _ANSI.sub("", raw.decode("utf-8", errors="replace")).replace("\r\n", "\n")


class ShellExited(Exception):
    """The exec stream ended: the shell (or its container) is gone. Internal; the sandbox turns it into a result
    or a ContainerDied."""


class _Sink(Protocol):
    def add(self, data: bytes) -> None: ...


class Discard:
    """A sink for output nobody reads (handshake echo, control replies)."""

    def add(self, data: bytes) -> None:
        pass


def exec_stream(sock: object) -> socket.socket | SshPipe:
    """What `Channel` talks to for the socket `exec_start(socket=True)` returned: the socket itself (the SDK wraps a
    unix one in a SocketIO), or an `SshPipe` for a host reached over ssh://."""
    raw = getattr(sock, "_sock", sock)
    return SshPipe(raw) if isinstance(getattr(raw, "proc", None), subprocess.Popen) else raw  # type: ignore[return-value]


class SshPipe:
    """The exec stream of an ssh:// host as a socket with timeouts. The Docker SDK's SSHSocket is a pipe pair to
    `ssh BOX docker system dial-stdio`: its recv(n) blocks until n bytes arrive and it ignores timeouts, so the
    shell protocol (small frames, deadlines) would hang on it. This reads the ssh process's stdout fd directly,
    after taking what the SDK's buffered reader already holds (bytes read past the HTTP response's head)."""

    def __init__(self, ssh_sock: object) -> None:
        proc: subprocess.Popen = ssh_sock.proc  # type: ignore[attr-defined]
        assert proc.stdout is not None and proc.stdin is not None
        self._ssh, self._out, self._in = ssh_sock, proc.stdout.fileno(), proc.stdin
        self._timeout: float | None = None
        os.set_blocking(self._out, False)
        self._early = bytearray()
        try:
            while chunk := proc.stdout.read1(self.READ_AHEAD):  # non-blocking: the buffer, then what the pipe holds
                self._early += chunk
        except BlockingIOError:
            pass
        os.set_blocking(self._out, True)

    READ_AHEAD = 64 * 1024

    def fileno(self) -> int:
        return self._out

    def settimeout(self, timeout: float | None) -> None:
        self._timeout = timeout

    def recv(self, n: int) -> bytes:
        if self._early:
            chunk = bytes(self._early[:n])
            del self._early[:n]
            return chunk
        readable, _, _ = select.select([self._out], [], [], self._timeout)
        if not readable:
            raise BlockingIOError if self._timeout == 0 else socket.timeout("timed out")
        return os.read(self._out, n)  # b"": ssh exited, the stream ended

    def send(self, data: memoryview | bytes) -> int:
        self._in.flush()  # whatever the SDK wrote through its buffered writer goes first
        _, writable, _ = select.select([], [self._in], [], self._timeout)
        if not writable:
            raise socket.timeout("timed out")
        return os.write(self._in.fileno(), data)

    def close(self) -> None:
        try:
            self._ssh.close()  # type: ignore[attr-defined]  # ends the ssh process
        except OSError:  # it had exited already
            pass


class Channel:
    """One exec socket (TTY: a raw byte stream, no multiplexing headers) with deadline-bounded I/O."""

    RECV_BYTES = 256 * 1024

    def __init__(self, sock: socket.socket | SshPipe) -> None:
        self.sock = sock
        self._pending = bytearray()

    def send(self, data: bytes, deadline: float) -> bool:
        """Write all of `data`; False when the deadline passed first (the shell is not reading)."""
        view = memoryview(data)
        while view:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                return False
            self.sock.settimeout(remaining)
            try:
                n = self.sock.send(view)
            except socket.timeout:
                return False
            except OSError as e:  # broken pipe / reset: the exec is gone
                raise ShellExited(str(e)) from e
            view = view[n:]
        return True

    def read_frame(self, token: str, deadline: float, sink: _Sink,
                   accept: Callable[[bytes], bool] = lambda payload: True) -> bytes | None:
        """Feed output to `sink` until a frame of `token` whose payload `accept`s; return that payload, or None
        when the deadline passes. Frames of the token that are not accepted are dropped from the output."""
        marker = b"\x1e" + token.encode("ascii") + b":"
        pending = self._pending
        while True:
            i = pending.find(marker)
            if i >= 0:
                j = pending.find(b"\x1e\n", i + len(marker))
                if j >= 0:
                    sink.add(bytes(pending[:i]))
                    payload = bytes(pending[i + len(marker):j])
                    del pending[:j + 2]
                    if accept(payload):
                        return payload
                    continue
                sink.add(bytes(pending[:i]))  # frame begun, its end not yet here
                del pending[:i]
            elif len(pending) >= len(marker):
                keep = len(marker) - 1  # a marker may straddle two reads
                sink.add(bytes(pending[:len(pending) - keep]))
                del pending[:len(pending) - keep]
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                return None
            self.sock.settimeout(remaining)
            try:
                chunk = self.sock.recv(self.RECV_BYTES)
            except socket.timeout:
                return None
            except OSError as e:
                raise ShellExited(str(e)) from e
            if not chunk:
                raise ShellExited("end of stream")
            pending += chunk

    def peer_closed(self) -> bool:
        """Whether the exec stream has ended, without a round trip: a zero-timeout look for end-of-stream. What
        is read meanwhile is kept for `read_frame` (a TLS socket cannot peek: a remote host over tcp+TLS)."""
        readable, _, _ = select.select([self.sock], [], [], 0)
        if not readable:
            return False
        self.sock.settimeout(0)
        try:
            chunk = self.sock.recv(self.RECV_BYTES)
        except (BlockingIOError, ssl.SSLWantReadError):
            return False
        except OSError:
            return True
        self._pending += chunk
        return chunk == b""

    def close(self) -> None:
        self.sock.close()

"""A set of interchangeable servers that survives losing some of them: which are up, where a request goes when its
server is lost, and waiting (bounded) for one to come back.

    fleet = Fleet(2, name=lambda k: urls[k], rejoin=lambda k: probe_and_resync(k), wait_s=600,
                  what="rollout server")
    k, answer = fleet.send(0, lambda k: post(k, body), rows=8, tally=resent)  # on server 0 if up, else on
                                    # another; a lost server is taken out and the request sent again (resent[0] += 8)
    fleet.try_rejoin()              # before a rollout: the lost ones that answer again
    fleet.servers_up()              # 2

A server is *lost* when a request to it raises `ServerLost` (nothing answers, the connection is refused or reset
after its retries, or the request passes its timeout): the first loss logs a warning naming it, its request goes to
the next server that is up (round-robin from it) and every later request of its block skips it. Requests are
deterministic (seeded samples, teacher-forced scores), so a request sent again gives the answer the lost server
would have given: a rollout's samples do not depend on which server drew them. A partial rollout's row (continued
across adapter versions) restarts from its prompt on the other server.

A lost server rejoins through `rejoin(k)`, the owner's check that it answers *and* serves what it must (the rollout
pool re-syncs the trainer's adapter and compares the digest the server reports; a teacher is probed as at start):
before each rollout (`try_rejoin`), and while no server is up. With none up a request waits, probing the lost ones
every PROBE_S with a progress line every `progress_every_s`, up to `wait_s`, then raises `FleetLost` (the run stops
in one line at its last checkpoint; a resume samples the rollout again). A SIGINT / SIGTERM stops the wait at once
(`jaxrl.utils.interrupt`).

Why no health-check thread: a lost server is found by the request that needed it, and probed only when a rollout
starts or nothing else is up, so a healthy fleet sends no extra traffic and a dead one costs one refused connect.
"""

from __future__ import annotations

import threading
import time
from typing import Callable, Optional, Sequence, TypeVar

from absl import logging

from jaxrl.utils import interrupt

T = TypeVar("T")

PROBE_S = 1.0  # with no server up, how often the lost ones are probed


class ServerLost(RuntimeError):
    """Raised by a request whose server did not answer at all (refused, reset, timed out); the fleet sends the
    request to another server. A server that answers with an error is not lost (that error stands)."""


class FleetLost(RuntimeError):
    """Every server of the fleet was lost and none came back within the wait; names them and the setting."""


class Fleet:
    """Servers 0 .. n-1 (named by `names`), all up at the start (module docstring)."""

    def __init__(self, size: int, *, name: Callable[[int], str], rejoin: Callable[[int], bool], wait_s: float,
                 progress_every_s: float = 30.0, what: str = "server",
                 wait_setting: str = "rollout_server.fleet_wait_s"):
        self.size = int(size)
        self.name = name  # server k's name in messages (its URL)
        self._rejoin = rejoin
        self.wait_s, self.progress_every_s = float(wait_s), float(progress_every_s)
        self.what, self.wait_setting = what, wait_setting
        self._lock = threading.RLock()
        self._probing = threading.Lock()  # one thread probes the lost servers at a time
        self._lost: dict[int, str] = {}  # server -> why it was taken out

    def up(self, among: Sequence[int]) -> list[int]:
        """The servers of `among` that are up now."""
        with self._lock:
            return [k for k in among if k not in self._lost]

    def is_up(self, k: int) -> bool:
        with self._lock:
            return k not in self._lost

    def lose(self, k: int, error: BaseException) -> None:
        """Takes server k out (a warning the first time)."""
        with self._lock:
            if k in self._lost:
                return
            self._lost[k] = str(error).split("; ")[0]  # what happened, not the advice after it
            left = self.size - len(self._lost)
        logging.warning("%s %s lost (%s): taken out of the fleet, its requests go to the %d left; it rejoins when "
                        "it answers again", self.what, self.name(k), error, left)

    def try_rejoin(self) -> list[int]:
        """Asks every lost server to rejoin (`rejoin(k)`); returns those back up."""
        with self._lock:
            lost = sorted(self._lost)
        back = []
        for k in lost:
            if self._attempt(k):
                back.append(k)
        return back

    def _attempt(self, k: int) -> bool:
        try:
            ok = bool(self._rejoin(k))
        except (ServerLost, OSError) as e:
            logging.debug("%s %s still lost: %s", self.what, self.name(k), e)
            return False
        except RuntimeError as e:  # it answers, but not as a member must (a refused adapter, a failed probe)
            logging.warning("%s %s answers again but cannot rejoin: %s", self.what, self.name(k), e)
            return False
        if ok:
            with self._lock:
                self._lost.pop(k, None)
            logging.warning("%s %s rejoined the fleet", self.what, self.name(k))
        return ok

    def send(self, k: int, call: Callable[[int], T], *, rows: int = 1, spread: int = 0, among: Sequence[int] = (),
             tally: Optional[list] = None) -> tuple[int, T]:
        """(the server that answered, `call(server)`): on server k while it is up, else on one of the others up
        of `among` (default: every server; which one: `spread`, e.g. the request's number, modulo their count, so
        a lost server's requests are shared out), a lost server taken out on the way. `tally[0]` counts the rows
        sent to a server other than k (module docstring)."""
        among = list(among) or list(range(self.size))
        server = k
        while True:
            if server != k or not self.is_up(k):
                up = [s for s in self.up(among) if s != k] or self.up(among)
                server = up[spread % len(up)] if up else self.wait_for_one(among)
                if tally is not None:
                    with self._lock:
                        tally[0] += rows
            try:
                return server, call(server)
            except ServerLost as e:
                self.lose(server, e)
                server = -1  # look for another

    def wait_for_one(self, among: Sequence[int]) -> int:
        """A server of `among` that is up, waiting up to `wait_s` for a lost one to rejoin (module docstring)."""
        start = last_line = time.monotonic()
        while True:
            up = self.up(among)
            if up:
                return up[0]
            if self._probing.acquire(blocking=False):  # one prober; the other waiting threads look again
                try:
                    for k in among:
                        if not self.is_up(k) and self._attempt(k):
                            return k
                finally:
                    self._probing.release()
            now = time.monotonic()
            if interrupt.requested() is not None:
                raise interrupt.Interrupted(interrupt.requested(), f"stopped while waiting for a {self.what} to "
                                            "come back")
            if now - start >= self.wait_s:
                raise FleetLost(f"every {self.what} is lost ({self.describe_lost()}) and none answered again "
                                f"within {self.wait_s:g} s ({self.wait_setting}); the run stops at its last "
                                "checkpoint: restart the servers and run the same command to resume")
            if self.progress_every_s and now - last_line >= self.progress_every_s:
                last_line = now
                logging.warning("no %s answers (%s): waited %.0f s of %g s (%s)", self.what, self.describe_lost(),
                                now - start, self.wait_s, self.wait_setting)
            time.sleep(PROBE_S)

    def describe_lost(self) -> str:
        with self._lock:
            return "; ".join(why if self.name(k) in why else f"{self.name(k)}: {why}"
                             for k, why in sorted(self._lost.items()))

    def servers_up(self) -> int:
        with self._lock:
            return self.size - len(self._lost)

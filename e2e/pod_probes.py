"""Container probes as the kubelet runs them: httpGet, tcpSocket and exec, with initialDelaySeconds,
periodSeconds, timeoutSeconds, successThreshold and failureThreshold.

`ProbeRunner.run` loops until cancelled and reports every flip of the probe's result through a callback;
the caller decides what a flip means (startup done, ready or not, kill the container).
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import aiohttp
from pod_env import PodSpecError


def _port(port: int | str, container: dict[str, Any]) -> int:
    if isinstance(port, int) or str(port).isdigit():
        return int(port)
    for p in container.get("ports") or []:
        if p.get("name") == port:
            return int(p["containerPort"])
    raise PodSpecError(f"probe port {port!r} is not a named port of container {container['name']}")


@dataclass
class ProbeRunner:
    probe: dict[str, Any]
    container: dict[str, Any]
    pod_ip: str
    netns: str
    pid: Callable[[], int | None]  # the container's process (exec probes enter its namespaces)

    @property
    def period(self) -> float:
        return float(self.probe.get("periodSeconds") or 10)

    async def check(self) -> tuple[bool, str]:
        timeout = float(self.probe.get("timeoutSeconds") or 1)
        try:
            if "httpGet" in self.probe:
                get = self.probe["httpGet"]
                scheme = (get.get("scheme") or "HTTP").lower()
                host = get.get("host") or self.pod_ip
                url = f"{scheme}://{host}:{_port(get['port'], self.container)}{get.get('path') or '/'}"
                headers = {h["name"]: h["value"] for h in get.get("httpHeaders") or []}
                async with (
                    aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=timeout)) as session,
                    session.get(url, headers=headers, ssl=False) as resp,
                ):
                    ok = 200 <= resp.status < 400
                    return ok, "" if ok else f"HTTP probe failed with statuscode: {resp.status}"
            if "tcpSocket" in self.probe:
                port = _port(self.probe["tcpSocket"]["port"], self.container)
                _, writer = await asyncio.wait_for(asyncio.open_connection(self.pod_ip, port), timeout)
                writer.close()
                return True, ""
            if "exec" in self.probe:
                pid = self.pid()
                if pid is None:
                    return False, "container not running"
                proc = await asyncio.create_subprocess_exec(
                    "nsenter", "-t", str(pid), "-m", "-n", "-u", "--", *self.probe["exec"]["command"],
                    stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.STDOUT,
                )  # fmt: skip
                try:
                    out, _ = await asyncio.wait_for(proc.communicate(), timeout)
                except TimeoutError:
                    proc.kill()
                    await proc.wait()
                    return False, f"command timed out after {timeout}s"
                return proc.returncode == 0, out.decode(errors="replace")[-1024:]
        except (OSError, TimeoutError, aiohttp.ClientError) as e:
            return False, f"probe failed: {type(e).__name__}: {e}"
        raise PodSpecError(f"unsupported probe handler {sorted(self.probe)}")

    async def run(self, on_result: Callable[[bool, str], None]) -> None:
        """Probe forever; `on_result(ok, message)` each time the thresholded result is known or flips."""
        successes = failures = 0
        state: bool | None = None
        await asyncio.sleep(float(self.probe.get("initialDelaySeconds") or 0))
        while True:
            ok, message = await self.check()
            successes, failures = (successes + 1, 0) if ok else (0, failures + 1)
            if ok and successes >= int(self.probe.get("successThreshold") or 1) and state is not True:
                state = True
                on_result(True, "")
            elif not ok and failures >= int(self.probe.get("failureThreshold") or 3) and state is not False:
                state = False
                on_result(False, message)
            await asyncio.sleep(self.period)

"""A load that shares the cores the way the server's event loop and the client do:
busy for `busy_ms`, idle for `idle_ms`, forever (one thread, pure Python)."""
import sys, time
busy, idle = float(sys.argv[1]) / 1e3, float(sys.argv[2]) / 1e3
while True:
    end = time.perf_counter() + busy
    while time.perf_counter() < end:
        pass
    time.sleep(idle)

"""Creates N topics with one durable subscription each on a running broker, for the idle-topics
memory figure: read the broker's VmRSS (/proc/PID/status) before and after.

    $MERIDIAN_PYTHON bench/idle_topics.py pulsar://127.0.0.1:6650 10000

Eight threads, each with its own client, subscribe to `idle-<i>` (Exclusive) and close the
consumer; the subscriptions stay (they are durable). Uses the stock `pulsar-client` package
that scripts/setup.sh installs.
"""
import sys
import threading
import time

import pulsar

THREADS = 8


def work(url, n, k):
    c = pulsar.Client(url, operation_timeout_seconds=60,
                      logger=pulsar.ConsoleLogger(pulsar.LoggerLevel.Error))
    for i in range(k, n, THREADS):
        c.subscribe(f"idle-{i}", "sub", consumer_type=pulsar.ConsumerType.Exclusive).close()
    c.close()


def main():
    url, n = sys.argv[1], int(sys.argv[2])
    t0 = time.time()
    threads = [threading.Thread(target=work, args=(url, n, k)) for k in range(THREADS)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    print(f"created {n} topics with a subscription each in {time.time() - t0:.1f} s")


if __name__ == "__main__":
    main()

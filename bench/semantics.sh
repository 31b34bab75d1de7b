#!/bin/bash
# Messaging-semantics figures with `meridian perf`, each part on a fresh standalone:
#  - Key_Shared, 8 consumers, 10,000 keys vs one Exclusive consumer, same rate, end-to-end
#    latency (target: Key_Shared p99 within 2x Exclusive's);
#  - 100,000 delayed messages held in a subscription's delay index: the broker's resident
#    memory before and after the index is built (target: at most 64 MiB for the index).
#
#   B=path/to/meridian [DIR=/var/tmp/meridian-sem] [RATE=20000] [SECONDS_PER_RUN=15] [RUNS=2] \
#   [PART=keyshared|delayed] bench/semantics.sh
# Everything listens on 127.0.0.1 only.
B=${B:?meridian binary}
D=${DIR:-/var/tmp/meridian-sem}; mkdir -p $D
RATE=${RATE:-20000}; S=${SECONDS_PER_RUN:-15}; RUNS=${RUNS:-2}
URL=pulsar://127.0.0.1:16710; HTTP=127.0.0.1:18710
start_m() { rm -rf $D/m; $B standalone --data-dir $D/m --pulsar-listen 127.0.0.1:16710 --http-listen $HTTP > $D/m.log 2>&1 & echo $! > $D/m.pid; sleep 2; }
stop_m() { kill -TERM $(cat $D/m.pid); while kill -0 $(cat $D/m.pid) 2>/dev/null; do sleep 0.2; done; rm -rf $D/m; }
if [ "${PART:-all}" = all ] || [ "$PART" = keyshared ]; then
for r in $(seq 1 $RUNS); do
  echo "== $RATE msg/s, 1 KiB, unbatched, 10,000 keys, run $r"
  start_m; echo "exclusive, 1 consumer:"
  $B perf e2e --url $URL --topic ex --rate $RATE --batch-max-messages 1 --keys 10000 --seconds $S \
     --report-every 100 --fsync-probe-dir $D | grep -E "summary|fdatasync"; stop_m
  start_m; echo "key_shared, 8 consumers:"
  $B perf e2e --url $URL --topic ks --rate $RATE --batch-max-messages 1 --keys 10000 --seconds $S \
     --subscription-type key-shared --consumers 8 --report-every 100 --fsync-probe-dir $D | grep -E "summary|fdatasync"; stop_m
done
fi
if [ "${PART:-all}" = all ] || [ "$PART" = delayed ]; then
  echo "== 100,000 messages of 1 KiB delayed by an hour; a shared subscription indexes them"
  start_m
  # The subscription exists before the messages, so it holds all of them.
  $B perf consume --url $URL --topic dl --subscription-type shared --seconds 1 --report-every 100 > /dev/null
  $B perf produce --url $URL --topic dl --messages 100000 --seconds 0 --batch-max-messages 1 \
     --deliver-after-ms 3600000 --report-every 100 | grep "summary produce:"
  sleep 5
  $B perf consume --url $URL --topic dl --subscription-type shared --seconds 20 --report-every 100 \
     --broker-pid $(cat $D/m.pid) --stats-http $HTTP | grep -E "summary|resident|stats"
  stop_m
fi

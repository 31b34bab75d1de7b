#!/bin/bash
# `meridian perf ledger` against bookies on loopback, a fresh cluster for every run: one
# metadata node, then one bookie (E=1) or three (E=3 Qw=2 Qa=2), alternating.
#
#   B=path/to/meridian [DIR=/var/tmp/meridian-ledger] [RUNS=3] [ENTRIES=100000] bench/ledger.sh
#
# Everything listens on 127.0.0.1 only; each process is stopped by its PID.
B=${B:?meridian binary}; D=${DIR:-/var/tmp/meridian-ledger}; RUNS=${RUNS:-3}; N=${ENTRIES:-100000}
M=127.0.0.1:17101
pids=()
start() { # number of bookies
  rm -rf $D; mkdir -p $D
  $B metadata --node-id 1 --listen $M --data-dir $D/meta --initial-members 1=$M > $D/meta.log 2>&1 & pids+=($!)
  sleep 2
  for i in $(seq 1 $1); do
    $B bookie --metadata $M --listen 127.0.0.1:1718$i --journal-dir $D/bk$i/journal --ledger-dir $D/bk$i/ledgers > $D/bk$i.log 2>&1 & pids+=($!)
  done
  sleep 3
}
stop() { for p in "${pids[@]}"; do kill -TERM $p; done; for p in "${pids[@]}"; do wait $p; done; pids=(); rm -rf $D; }
for r in $(seq 1 $RUNS); do
  echo "== run $r"
  start 1; echo -n "E=1:           "; $B perf ledger --metadata $M --ensemble 1 --write-quorum 1 --ack-quorum 1 --entries $N --entry-size 1024 --window 1000 | tail -2 | tr '\n' ' '; echo; stop
  start 3; echo -n "E=3 Qw=2 Qa=2: "; $B perf ledger --metadata $M --ensemble 3 --write-quorum 2 --ack-quorum 2 --entries $N --entry-size 1024 --window 1000 | tail -2 | tr '\n' ' '; echo; stop
done

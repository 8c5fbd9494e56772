#!/usr/bin/env bash
# fuzz-summary.sh FUZZTIME STATUS < output-of-go-test-fuzz
#
# Prints the one-line summary of a `go test -fuzz` run, from its output on stdin and its exit
# status: reliability: fuzz: fuzztime=30000x execs=N new_interesting=M failures=F
#
# execs and new_interesting are the last values go's fuzzing engine reported ("fuzz: elapsed: 60s,
# execs: 12345 (205/sec), new interesting: 3 (total: 17)"). failures is 0 for a run that exited 0
# and reported progress, else the number of failing tests or inputs reported (at least 1).
set -euo pipefail
fuzztime=${1:?usage: fuzz-summary.sh FUZZTIME STATUS < go-test-output}
status=${2:?usage: fuzz-summary.sh FUZZTIME STATUS < go-test-output}
awk -v fuzztime="$fuzztime" -v status="$status" '
	match($0, /execs: [0-9]+/) { execs = substr($0, RSTART + 7, RLENGTH - 7); seen = 1 }
	match($0, /new interesting: [0-9]+/) { interesting = substr($0, RSTART + 17, RLENGTH - 17) }
	/^--- FAIL: / || /^panic: / { fails++ }
	/Failing input written to / { failing = failing " " $NF }
	END {
		failures = 0
		if (status != 0 || !seen) { failures = fails > 0 ? fails : 1 }
		printf "reliability: fuzz: fuzztime=%s execs=%d new_interesting=%d failures=%d\n", fuzztime, execs, interesting, failures
		if (failing != "") { printf "  failing input(s) kept for replay:%s\n", failing }
		if (status == 0 && !seen) { print "  the fuzz run exited 0 but reported no executions" }
	}'

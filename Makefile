# The two commands of the README. Everything they need is installed by hack/venv.
.PHONY: demo test bench

demo:
	hack/demo

test:
	hack/test

# Not one of the two set-up commands: a full benchmark run (35-80 minutes here, ~20 GiB of memory).
bench:
	hack/bench --reps 5 --out docs/benchmarks --bucket local

# The two commands of the README. Everything they need is installed by hack/venv.
.PHONY: demo test

demo:
	hack/demo

test:
	hack/test

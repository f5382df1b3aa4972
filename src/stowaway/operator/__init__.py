"""The Kubernetes operator: CheckpointPolicy status and the sidecar-injection webhook.

Rule: the builders (:mod:`injection`, :mod:`policy`, :mod:`certificates`,
:mod:`settings`) are pure functions of their arguments, with no cluster
access, so they are tested without one; only :mod:`main` talks to kopf and the
API server (through :mod:`cluster`), and only :mod:`metrics` to
``prometheus_client``. The operator never imports torch, and never imports the sidecar.
"""

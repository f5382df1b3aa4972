# One slim image, two entrypoints: `python -m stowaway.operator` and `stowaway sidecar ...` (the chart and the
# webhook set the command). No torch: the operator and the sidecar never import it.
# BASE: any Debian bookworm image with Python 3.11 and pip on PATH; the e2e tests build one locally
# (hack/e2e/images), where no image registry is reachable.
ARG BASE=python:3.11-slim-bookworm
FROM ${BASE} AS build
WORKDIR /src
COPY pyproject.toml README.md ./
COPY src ./src
RUN pip wheel --no-cache-dir --wheel-dir /wheels ".[operator]"

FROM ${BASE}
ENV PYTHONDONTWRITEBYTECODE=1 PYTHONUNBUFFERED=1
COPY --from=build /wheels /wheels
# 65532: the uid the chart and the injected sidecar run as (non-root). It gets a name: kopf names the operator's
# peering identity after getpass.getuser(), which fails for a uid that /etc/passwd does not list.
RUN pip install --no-cache-dir --no-index /wheels/*.whl && rm -rf /wheels \
    && python -c "import importlib.util, sys; sys.exit(importlib.util.find_spec('torch') is not None)" \
    && useradd --system --uid 65532 --user-group --no-create-home --home-dir /nonexistent \
        --shell /usr/sbin/nologin stowaway
USER 65532:65532
CMD ["python", "-m", "stowaway.operator"]

# One slim image, two entrypoints: `python -m stowaway.operator` and `stowaway sidecar ...` (the chart and the
# webhook set the command). No torch: the operator and the sidecar never import it.
FROM python:3.11-slim-bookworm AS build
WORKDIR /src
COPY pyproject.toml README.md ./
COPY src ./src
RUN pip wheel --no-cache-dir --wheel-dir /wheels ".[operator]"

FROM python:3.11-slim-bookworm
ENV PYTHONDONTWRITEBYTECODE=1 PYTHONUNBUFFERED=1
COPY --from=build /wheels /wheels
RUN pip install --no-cache-dir --no-index /wheels/*.whl && rm -rf /wheels \
    && python -c "import importlib.util, sys; sys.exit(importlib.util.find_spec('torch') is not None)"
# 65532: the uid the chart and the injected sidecar run as (non-root).
USER 65532:65532
CMD ["python", "-m", "stowaway.operator"]

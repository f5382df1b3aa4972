# The trainer of the e2e tests: torch, the Stowaway client and examples/train.py, run as uid 1000 (the pods add
# an fsGroup). The context is the repository root.
ARG BASE
FROM ${BASE}
# The package index's Linux torch wheels are CUDA builds: their NVIDIA libraries are needed to import torch
# even on CPU, but triton (torch.compile only) is not, and is removed to keep the image smaller.
ARG TORCH_VERSION=2.15.0
RUN pip install --no-cache-dir "torch==${TORCH_VERSION}" "numpy>=1.26" \
    && pip uninstall -y triton
COPY pyproject.toml README.md /src/
COPY src /src/src
RUN pip install --no-cache-dir /src && rm -rf /src
COPY examples/train.py /app/train.py
WORKDIR /app
USER 1000:1000
CMD ["python", "/app/train.py"]

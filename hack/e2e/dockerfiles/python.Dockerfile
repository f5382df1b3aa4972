# A stand-in for python:3.11-slim-bookworm, made from the locally debootstrapped Debian bookworm (whose python3
# is 3.11): `python` and `pip` on PATH, installing into the system like the official image does.
# pip trusts the CA bundle the host's pip trusts (host-ca.pem in the build context): the package index is
# reached through the same network as the host's. This image is for the tests only; users build from the
# public python image.
ARG BASE
FROM ${BASE}
COPY host-ca.pem /etc/ssl/certs/stowaway-host-ca.pem
RUN apt-get update \
    && DEBIAN_FRONTEND=noninteractive apt-get install -y --no-install-recommends \
        python3 python3-pip python3-venv ca-certificates \
    && rm -rf /var/lib/apt/lists/* \
    && rm -f /usr/lib/python3*/EXTERNALLY-MANAGED \
    && ln -s /usr/bin/python3 /usr/local/bin/python && ln -s /usr/bin/pip3 /usr/local/bin/pip
ENV PIP_CERT=/etc/ssl/certs/stowaway-host-ca.pem LANG=C.UTF-8
CMD ["python3"]

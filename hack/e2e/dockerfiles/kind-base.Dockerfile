# The base of the kind node image, after kind's own images/base/Dockerfile (the kind release's files/ tree is
# copied into the context by hack/e2e/node-image): systemd as init, Debian's packages, and a container
# runtime (containerd, runc, crictl, CNI plugins) compiled here from the Go module proxy rather than
# downloaded from release pages. The legacy builder has no COPY --chmod, hence the chmods.
# restrict_oom_score_adj (set by kind's entrypoint for rootless nodes only): containerd asks for no lower OOM
# score than its own, since lowering one needs CAP_SYS_RESOURCE, which some machines withhold even from root.
ARG BASE
FROM ${BASE}
COPY files/ /
RUN chmod 0755 /usr/local/bin/* /kind /kind/bin /kind/bin/* \
    && apt-get update \
    && DEBIAN_FRONTEND=noninteractive apt-get install -y --no-install-recommends \
        systemd conntrack iptables nftables iproute2 ethtool util-linux mount kmod \
        libseccomp2 pigz bash ca-certificates curl jq procps e2fsprogs \
    && apt-get clean -y \
    && rm -rf /var/lib/apt/lists/* /var/log/* /usr/share/doc/* /usr/share/man/* \
    && find /lib/systemd/system/sysinit.target.wants/ -name "systemd-tmpfiles-setup.service" -delete \
    && rm -f /lib/systemd/system/multi-user.target.wants/* \
    && rm -f /etc/systemd/system/*.wants/* \
    && rm -f /lib/systemd/system/local-fs.target.wants/* \
    && rm -f /lib/systemd/system/sockets.target.wants/*udev* \
    && rm -f /lib/systemd/system/sockets.target.wants/*initctl* \
    && rm -f /lib/systemd/system/basic.target.wants/* \
    && echo "ReadKMsg=no" >> /etc/systemd/journald.conf \
    && ln -sf /usr/lib/systemd/systemd /sbin/init \
    && systemctl enable kubelet.service containerd.service undo-mount-hacks.service \
    && systemctl mask systemd-binfmt.service \
    && mkdir -p /etc/kubernetes/manifests \
    && sed -i 's/restrict_oom_score_adj = false/restrict_oom_score_adj = true/' /etc/containerd/config.toml
COPY bin/ /usr/local/bin/
COPY cni/ /opt/cni/bin/
RUN mv /usr/local/bin/runc /usr/local/sbin/runc \
    && chmod 0755 /usr/local/bin/* /usr/local/sbin/runc /opt/cni/bin/* \
    && ctr oci spec \
        | jq '.hooks.createContainer[.hooks.createContainer| length] |= . + {"path": "/kind/bin/mount-product-files.sh"}' \
        | jq 'del(.process.rlimits)' \
        > /etc/containerd/cri-base.json \
    && containerd --version && runc --version && crictl --version
ENV container=docker
STOPSIGNAL SIGRTMIN+3
ENTRYPOINT [ "/usr/local/bin/entrypoint", "/sbin/init" ]

# Shortcuts for the scripts the README describes.
.PHONY: run test cluster-up cluster-down image

run:
	bash scripts/run.sh

test:
	bash scripts/test.sh

# NODES=3: three nodes on one bridge (docs/cluster.md); PLUGIN=ptp-cns-ipam, FLAT=0, DUAL=1
# (IPv4 and IPv6) likewise.
cluster-up:
	bash scripts/cluster.sh up $(if $(NODES),--nodes $(NODES)) $(if $(PLUGIN),--plugin $(PLUGIN)) \
		$(if $(filter 0,$(FLAT)),--no-flat-network) $(if $(filter 1,$(DUAL)),--dual-stack)

cluster-down:
	bash scripts/cluster.sh down $(if $(KEEP_LOGS),--keep-logs)

# The container image localhost/cns:<version>-<inputs hash> (Containerfile; offline, podman).
image:
	bash scripts/build-image.sh

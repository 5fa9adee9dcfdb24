# Shortcuts for the scripts the README describes.
.PHONY: run test cluster-up cluster-down image

run:
	bash scripts/run.sh

test:
	bash scripts/test.sh

cluster-up:
	bash scripts/cluster.sh up

cluster-down:
	bash scripts/cluster.sh down

# The container image localhost/cns:<version>-<inputs hash> (Containerfile; offline, podman).
image:
	bash scripts/build-image.sh

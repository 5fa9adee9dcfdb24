# Shortcuts for the scripts the README describes.
.PHONY: run test cluster-up cluster-down

run:
	bash scripts/run.sh

test:
	bash scripts/test.sh

cluster-up:
	bash scripts/cluster.sh up

cluster-down:
	bash scripts/cluster.sh down

"""An import-linter contract type the built-in ones lack: "these packages use the stdlib only".

The CNI plugins run once per pod under `python3 -I -S` (no site-packages) and are copied alone to
the node by `cns install-cni`, so an import of anything outside the standard library and the plugin
package itself would fail on a real node while passing every test run from the repository. The
built-in `forbidden` contract needs the forbidden packages named one by one; this one allows a
list instead: the running interpreter's `sys.stdlib_module_names`, plus `allowed` (for a stdlib
name of another Python version). Configured in pyproject.toml, run by `lint-imports`
(scripts/test.sh); tests/unit/test_layering.py checks that it can fail.
"""

from __future__ import annotations

import sys

from grimp import ImportGraph
from importlinter import Contract, ContractCheck, fields, output


class StdlibOnlyContract(Contract):
    """The modules of `packages` import nothing but the stdlib, `allowed` and `packages`."""

    type_name = "stdlib_only"

    packages = fields.ListField(subfield=fields.StringField())
    allowed = fields.ListField(subfield=fields.StringField(), required=False, default=[])

    def check(self, graph: ImportGraph, verbose: bool) -> ContractCheck:
        packages = list(self.packages)
        allowed = set(sys.stdlib_module_names) | set(self.allowed) | set(packages)
        found: list[str] = []
        for package in packages:
            for module in sorted({package} | graph.find_descendants(package)):
                for imported in sorted(graph.find_modules_directly_imported_by(module)):
                    if imported.split(".")[0] in allowed:
                        continue
                    for detail in graph.get_import_details(importer=module, imported=imported):
                        found.append(
                            f"{module} imports {imported} "
                            f"(l.{detail['line_number']}: {detail['line_contents']})"
                        )
        return ContractCheck(kept=not found, metadata={"found": found})

    def render_broken_contract(self, check: ContractCheck) -> None:
        for line in check.metadata["found"]:
            output.print_error(line, bold=False)
            output.new_line()

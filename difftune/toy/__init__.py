"""The toy tooling, apart from the library: micro models built from config classes and synthetic shape renders
(`tiny`), the bundled tiny bases' builder (`tiny_base`) and the turbo base's distillation (`turbo`), the shapes judge
behind `difftune eval` (`judge`), each family's shipped job on its micro model (`family_jobs`) and the benchmark's
model shapes (`bench`). It is how difftune is tested and measured with no downloads.

May import any library layer. The library never imports it: the shapes judge is registered for
`validation.eval_concept` as an entry point (pyproject.toml), and only the CLI's `difftune eval` calls it by name.
"""

"""The experiments wing: `sweep` (grids and random samples of configs, locally or on Ray Tune),
`runs` (reading run folders), `report` (the HTML comparison page), `plot` (training curves).

May import: `training` and every wing below it; not `serve`, `export` or `cli`."""

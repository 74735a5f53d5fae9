"""The recipes shipped with growtrain, installed as package data of `growtrain.recipes`:
`growtrain run tiny` finds recipes/tiny.yaml when no file of that name is in the working directory."""

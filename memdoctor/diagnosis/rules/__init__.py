"""One file per cause: each rule reads Facts and returns a Finding or nothing."""

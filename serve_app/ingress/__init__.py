"""The HTTP ingress: one mixin per control capability, each with its own endpoint map."""

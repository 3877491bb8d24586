module sigs.k8s.io/iptables-wrappers

go 1.24.0

require k8s.io/api v0.34.0

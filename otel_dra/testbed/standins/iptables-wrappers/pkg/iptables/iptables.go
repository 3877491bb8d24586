// Package iptables stands in for sigs.k8s.io/iptables-wrappers/pkg/iptables, which the kubelet
// imports from Kubernetes 1.38 on and which the Go module proxy reachable here refuses (403 for
// every version). Test infrastructure only: the testbed's kubelet is built with this module in
// place of the real one (a replace line of the wrapper module, see otel_dra/testbed/releases.py).
//
// It declares exactly what k8s.io/kubernetes/pkg/kubelet/kubelet_network_linux.go uses, and
// NewBestEffort finds no iptables, so the kubelet takes its own path for hosts without iptables
// ("No iptables support on this system; not creating the KUBE-IPTABLES-HINT chain") and leaves
// the host's chains alone. Nothing else in the kubelet needs iptables.
package iptables

import (
	"context"
	"errors"
	"time"

	v1 "k8s.io/api/core/v1"
)

// Chain is an iptables chain name.
type Chain string

// Table is an iptables table name.
type Table string

// RulePosition says where EnsureRule puts a rule.
type RulePosition string

// Protocol is the IP family of a client.
type Protocol string

// Mode chooses between the legacy and the nft back end.
type Mode string

const (
	ChainInput  Chain = "INPUT"
	ChainOutput Chain = "OUTPUT"

	TableFilter Table = "filter"
	TableMangle Table = "mangle"
	TableNAT    Table = "nat"

	Prepend RulePosition = "-I"
	Append  RulePosition = "-A"

	ProtocolIPv4 Protocol = "IPv4"
	ProtocolIPv6 Protocol = "IPv6"

	UseInstalledMode Mode = "installed"
)

// Interface is the part of the real package's client that the kubelet calls.
type Interface interface {
	Protocol() Protocol
	IsIPv6() bool
	EnsureChain(ctx context.Context, table Table, chain Chain) (bool, error)
	EnsureRule(ctx context.Context, position RulePosition, table Table, chain Chain, args ...string) (bool, error)
	Monitor(ctx context.Context, canary Chain, tables []Table, reloadFunc func(), interval time.Duration)
}

// ErrNotAvailable is what a client would answer; none is ever handed out.
var ErrNotAvailable = errors.New("iptables-wrappers stand-in: no iptables")

// NewBestEffort returns the iptables clients that work on this host: none.
func NewBestEffort(_ context.Context, _ Mode) map[v1.IPFamily]Interface {
	return map[v1.IPFamily]Interface{}
}

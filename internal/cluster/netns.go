package cluster

import (
	"context"
	"fmt"
	"net"
	"net/netip"
	"time"

	"github.com/ip-masq-agent/ip-masq-agent/internal/testutil"
)

// NetnsPrefix starts the name of every network namespace the cluster creates, so that a check
// for leftovers (and a person) can tell them apart.
const NetnsPrefix = "ipmasq-k8s-"

// cmdTimeout bounds each ip, nsenter or ctr command the harness runs.
const cmdTimeout = 30 * time.Second

// newNetns creates the run's network namespace of a role (run.netnsName) with its loopback up.
func (r *run) newNetns(ctx context.Context, role string) (string, error) {
	name := r.netnsName(role)
	if err := testutil.CreateNetns(ctx, name); err != nil {
		return "", err
	}
	if _, err := ip(ctx, "-n", name, "link", "set", "lo", "up"); err != nil {
		_ = testutil.DeleteNetns(ctx, name)
		return "", err
	}
	return name, nil
}

// netnsPath is the namespace file of a named network namespace.
func netnsPath(name string) string { return "/run/netns/" + name }

func ip(ctx context.Context, args ...string) (string, error) {
	return Namespaces{}.Run(ctx, cmdTimeout, append([]string{"ip"}, args...)...)
}

// dialIn returns a dialer whose connections are made inside the named network namespace, so
// this process reaches the cluster without any route in its own namespace.
func dialIn(ns string) func(ctx context.Context, network, address string) (net.Conn, error) {
	return func(ctx context.Context, network, address string) (net.Conn, error) {
		var conn net.Conn
		err := testutil.Do(ns, func() error {
			var d net.Dialer
			c, err := d.DialContext(ctx, network, address)
			conn = c
			return err
		})
		return conn, err
	}
}

// Link is a veth pair between two network namespaces, each end with an address of a /30 (or
// /126) whose first host is A's and second is B's.
type Link struct {
	NsA, NameA, NsB, NameB string
	Net                    netip.Prefix
}

// AddrA and AddrB are the ends' addresses.
func (l Link) AddrA() netip.Addr { return l.Net.Addr().Next() }
func (l Link) AddrB() netip.Addr { return l.Net.Addr().Next().Next() }

// create makes the pair, moves each end into its namespace, addresses both and sets them up.
func (l Link) create(ctx context.Context) error {
	// The peer is made in NsB directly, so its name need only be free there.
	if _, err := ip(ctx, "-n", l.NsA, "link", "add", l.NameA, "type", "veth", "peer", "name", l.NameB, "netns", l.NsB); err != nil {
		return err
	}
	for _, end := range []struct {
		ns, name string
		addr     netip.Addr
	}{{l.NsA, l.NameA, l.AddrA()}, {l.NsB, l.NameB, l.AddrB()}} {
		args := []string{"-n", end.ns, "addr", "add", netip.PrefixFrom(end.addr, l.Net.Bits()).String(), "dev", end.name}
		if end.addr.Is6() {
			args = append(args, "nodad")
		}
		if _, err := ip(ctx, args...); err != nil {
			return err
		}
		if _, err := ip(ctx, "-n", end.ns, "link", "set", end.name, "up"); err != nil {
			return err
		}
	}
	return nil
}

// route adds a route in ns to dst via gw.
func route(ctx context.Context, ns string, dst netip.Prefix, gw netip.Addr) error {
	family := "-4"
	if dst.Addr().Is6() {
		family = "-6"
	}
	if _, err := ip(ctx, family, "-n", ns, "route", "replace", dst.String(), "via", gw.String()); err != nil {
		return fmt.Errorf("route %s via %s in %s: %w", dst, gw, ns, err)
	}
	return nil
}

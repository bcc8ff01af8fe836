package e2e

import (
	"context"
	"fmt"
	"net"
	"net/netip"
	"os/exec"
	"strings"
	"testing"
	"time"

	"github.com/ip-masq-agent/ip-masq-agent/internal/testutil"
	"github.com/ip-masq-agent/ip-masq-agent/pkg/bpf"
)

// Secondary networks (Multus): children of the uplink in namespaces of their own, with addresses
// of the uplink's network. Their frames cross the uplink's hooks but never the node's IP stack:
// iptables never sees them, and neither may the BPF datapath touch them.

var (
	childAddr4 = netip.MustParseAddr("10.99.0.50")
	childAddr6 = netip.MustParseAddr("2001:db8:99::50")
)

// addChild moves a child device of the node's uplink (created by linkArgs, named dev) into a
// namespace of its own, with addr4/24 and addr6/64 and default routes via gw4 and gw6.
func (tp *Topology) addChild(ctx context.Context, t testing.TB, dev, linkArgs string, addr4, addr6, gw4, gw6 netip.Addr) string {
	t.Helper()
	ns := testutil.NewNetns(t)
	if err := WriteSysctl(ns, "net.ipv6.conf.all.accept_dad", "0"); err != nil {
		t.Fatal(err)
	}
	if err := testutil.IPBatch(ctx, tp.Node, fmt.Sprintf("link add %s %s\nlink set %s netns %s\n", dev, linkArgs, dev, ns)); err != nil {
		t.Fatalf("add %s: %v", dev, err)
	}
	if err := testutil.IPBatch(ctx, ns, fmt.Sprintf(`link set lo up
addr add %s/24 dev %s
addr add %s/64 dev %s nodad
link set %s up
route add default via %s dev %s
route add default via %s dev %s
`, addr4, dev, addr6, dev, dev, gw4, dev, gw6, dev)); err != nil {
		t.Fatalf("set up %s: %v", dev, err)
	}
	return ns
}

// checkChild probes from a child over TCP and UDP, both families: the external host must see the
// child's own address and answer it; the pod's traffic stays masqueraded.
func checkChild(ctx context.Context, t *testing.T, env *Env, ns string, addr4, addr6 netip.Addr) {
	t.Helper()
	for _, c := range []struct{ from, to netip.Addr }{
		{addr4, netip.MustParseAddr("8.8.8.8")}, {addr6, netip.MustParseAddr("2001:4860:4860::8888")},
	} {
		for _, proto := range []string{"tcp", "udp"} {
			src, err := env.ProbeFrom(ctx, ns, c.from, proto, c.to)
			if err != nil {
				t.Errorf("child %s: %v", c.from, err)
				continue
			}
			if src.Addr() != c.from {
				t.Errorf("child %s to %s over %s: the external host saw %s, want the child's own address", c.from, c.to, proto, src)
			}
		}
	}
	env.Check(ctx, t, expect(Masq, "8.8.8.8", "2001:4860:4860::8888"), nil)
}

// TestMacvlanChild: a macvlan child of the uplink (bridge mode, its own namespace and address on
// the uplink's network) keeps its address and gets its replies, on every backend.
func TestMacvlanChild(t *testing.T) {
	eachBackend(t, backends(), []string{"--enable-ipv6"}, func(ctx context.Context, t *testing.T, b Backend, env *Env) {
		env.StartReady(ctx, t, b, "masqOutBound: true\n")
		ns := env.addChild(ctx, t, "mv0", "link "+Uplink+" type macvlan mode bridge", childAddr4, childAddr6, ExtAddr4, ExtAddr6)
		checkChild(ctx, t, env, ns, childAddr4, childAddr6)
	})
}

// require8021q makes sure the kernel can create VLAN devices, loading 8021q if it must. A kernel
// that has no 8021q and cannot load it (no module, or no modprobe) skips the test even in CI:
// there is nothing the test could run on; one that loads it but still creates no VLAN device
// fails.
func require8021q(ctx context.Context, t *testing.T) {
	t.Helper()
	try := func() error {
		ns := testutil.NewNetns(t)
		return testutil.IPBatch(ctx, ns, "link add probe0 type dummy\nlink add link probe0 name probe0.7 type vlan id 7\n")
	}
	err := try()
	if err == nil {
		return
	}
	modprobe, lookErr := exec.LookPath("modprobe")
	if lookErr != nil {
		t.Skipf("the kernel has no 8021q (%v), and there is no modprobe to load it", err)
	}
	mctx, cancel := context.WithTimeout(ctx, 10*time.Second)
	defer cancel()
	if out, merr := exec.CommandContext(mctx, modprobe, "8021q").CombinedOutput(); merr != nil {
		t.Skipf("the kernel has no 8021q (%v), and it cannot be loaded: %v: %s", err, merr, strings.TrimSpace(string(out)))
	}
	if err := try(); err != nil {
		t.Fatalf("8021q is loaded, yet no VLAN device can be made: %v", err)
	}
}

// TestVLANChild: a VLAN sub-interface of the uplink in its own namespace (a Multus vlan
// network), on a VLAN of its own to the external host: its frames reach the uplink's hooks
// tagged, keep their address and get their replies, on every backend.
func TestVLANChild(t *testing.T) {
	eachBackend(t, backends(), []string{"--enable-ipv6"}, func(ctx context.Context, t *testing.T, b Backend, env *Env) {
		require8021q(ctx, t)
		env.StartReady(ctx, t, b, "masqOutBound: true\n")
		vlan4, vlan6 := netip.MustParseAddr("10.98.0.50"), netip.MustParseAddr("2001:db8:98::50")
		gw4, gw6 := netip.MustParseAddr("10.98.0.2"), netip.MustParseAddr("2001:db8:98::2")
		if err := testutil.IPBatch(ctx, env.Ext, fmt.Sprintf(`link add link eth0 name eth0.100 type vlan id 100
addr add %s/24 dev eth0.100
addr add %s/64 dev eth0.100 nodad
link set eth0.100 up
`, gw4, gw6)); err != nil {
			t.Fatal(err)
		}
		ns := env.addChild(ctx, t, Uplink+".100", "link "+Uplink+" type vlan id 100", vlan4, vlan6, gw4, gw6)
		checkChild(ctx, t, env, ns, vlan4, vlan6)
	})
}

// TestUplinkMACChange: the uplink takes another MAC address, as a bond does when it fails over
// with fail_over_mac=active (its new active slave's): the pod's new flows right after it are
// masqueraded, on every backend, where the BPF scope check once took them, until the agent
// followed the change, for frames bridged onto the uplink and let them leave with the pod's
// address; the agent then records the new MAC.
func TestUplinkMACChange(t *testing.T) {
	const failedOver = "02:00:00:0b:0b:01"
	eachBackend(t, backends(), []string{"--enable-ipv6"}, func(ctx context.Context, t *testing.T, b Backend, env *Env) {
		env.StartReady(ctx, t, b, "masqOutBound: true\n")
		dsts := []netip.Addr{netip.MustParseAddr("8.8.8.8"), netip.MustParseAddr("2001:4860:4860::8888")}
		if err := testutil.IPBatch(ctx, env.Node, "link set "+Uplink+" address "+failedOver+"\n"); err != nil {
			t.Fatal(err)
		}
		// The external host learns the new MAC as a bond's gratuitous ARP would teach it.
		if err := testutil.IPBatch(ctx, env.Ext, "neigh flush all\n"); err != nil {
			t.Fatal(err)
		}
		for start := time.Now(); time.Since(start) < 500*time.Millisecond; {
			for _, dst := range dsts {
				want, src, err := env.Observe(ctx, "udp", dst)
				if err != nil {
					t.Fatal(err)
				}
				if want != Masq {
					t.Fatalf("%v after the MAC change, a new flow to %s left as %s, want masqueraded", time.Since(start), dst, src)
				}
			}
		}
		if !b.NAT { // the BPF datapath's scope check is the only one with a MAC
			return
		}
		want := bpf.MACOf(mustMAC(t, failedOver))
		if err := testutil.Poll(10*time.Second, 50*time.Millisecond, func() error {
			dp, err := bpf.OpenPinnedReadOnly(env.PinDir())
			if err != nil {
				return err
			}
			u, _, err := dp.Uplink(env.UplinkIndex(t))
			dp.Close()
			if err == nil && u.MAC == want {
				return nil
			}
			return testutil.NotYet("uplink_macs holds %s (%v), want the new MAC %s", u.MAC, err, want)
		}); err != nil {
			t.Fatal(err)
		}
	})
}

func mustMAC(t testing.TB, s string) net.HardwareAddr {
	t.Helper()
	hw, err := net.ParseMAC(s)
	if err != nil {
		t.Fatal(err)
	}
	return hw
}

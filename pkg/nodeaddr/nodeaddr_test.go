package nodeaddr

import (
	"context"
	"errors"
	"fmt"
	"net/netip"
	"os"
	"runtime"
	"strings"
	"testing"
	"time"

	"golang.org/x/sys/unix"

	"github.com/ip-masq-agent/ip-masq-agent/internal/testutil"
	"github.com/ip-masq-agent/ip-masq-agent/pkg/config"
	"github.com/ip-masq-agent/ip-masq-agent/pkg/policy"
	"github.com/ip-masq-agent/ip-masq-agent/pkg/uplink"
)

// TestMissingMessages: the error names each missing address with the key that names it, and
// what the uplinks have.
func TestMissingMessages(t *testing.T) {
	a := netip.MustParseAddr
	set := uplink.Set{Uplinks: []uplink.Uplink{{Name: "eth0", Index: 2}, {Name: "eth1", Index: 3}},
		Addrs: map[int][]netip.Addr{2: {a("10.0.0.10"), a("10.0.0.11")}, 3: {}}}
	for _, c := range []struct {
		uses []policy.AddressUse
		set  uplink.Set
		want string
	}{
		{[]policy.AddressUse{{Addr: a("10.0.0.11"), From: "masqueradeAddress"}}, set, ""},
		{[]policy.AddressUse{{Addr: a("10.0.0.77"), From: "masqueradeAddress"}, {Addr: a("10.0.0.11"), From: "masqueradeCIDRs[0]"}}, set,
			"masqueradeAddress 10.0.0.77 is not an address of the node's uplinks (eth0: 10.0.0.10, 10.0.0.11; eth1: no address)"},
		{[]policy.AddressUse{{Addr: a("10.0.0.77"), From: "masqueradeAddress"}, {Addr: a("10.0.0.78"), From: "masqueradeCIDRs[1]"}}, set,
			"masqueradeAddress 10.0.0.77, masqueradeCIDRs[1] 10.0.0.78 are not addresses of the node's uplinks (eth0: 10.0.0.10, 10.0.0.11; eth1: no address)"},
		{[]policy.AddressUse{{Addr: a("10.0.0.11"), From: "masqueradeAddress"}}, uplink.Set{},
			"masqueradeAddress 10.0.0.11 is not an address of the node's uplinks (the node has no uplink: no default route, and no route toward a masqueraded destination)"},
		{[]policy.AddressUse{{Addr: a("10.0.0.11"), From: "masqueradeAddress"}}, uplink.Set{Missing: []string{"bond0"}},
			"masqueradeAddress 10.0.0.11 is not an address of the node's uplinks (none of --interfaces bond0 exists)"},
	} {
		err := Missing(c.uses, c.set)
		got := ""
		if err != nil {
			got = err.Error()
		}
		if got != c.want {
			t.Errorf("Missing(%v):\n got  %q\n want %q", c.uses, got, c.want)
		}
		var me *MissingError
		if c.want != "" && (!errors.As(err, &me) || me.MissingAddresses()[0] != c.uses[0].Addr) {
			t.Errorf("Missing(%v) = %#v, want a MissingError with %s", c.uses, err, c.uses[0].Addr)
		}
	}
}

// inNetns runs fn on a thread of its own inside the namespace, and returns once fn has.
func inNetns(t *testing.T, ns string, fn func()) {
	t.Helper()
	if err := <-goInNetns(t, ns, fn); err != nil {
		t.Fatalf("enter netns %s: %v", ns, err)
	}
}

// goInNetns starts fn on a thread of its own inside the namespace (never reused after), and
// returns a channel that receives nil once fn returned, or the error of entering.
func goInNetns(t *testing.T, ns string, fn func()) <-chan error {
	t.Helper()
	f, err := os.Open("/run/netns/" + ns)
	if err != nil {
		t.Fatal(err)
	}
	done := make(chan error, 1)
	go func() {
		defer f.Close()
		runtime.LockOSThread() // never unlocked: the thread ends with the goroutine
		if err := unix.Setns(int(f.Fd()), unix.CLONE_NEWNET); err != nil {
			done <- err
			return
		}
		fn()
		done <- nil
	}()
	return done
}

func ip(t *testing.T, ns, batch string) {
	t.Helper()
	if err := testutil.IPBatch(context.Background(), ns, batch); err != nil {
		t.Fatal(err)
	}
}

// TestCheckerFollowsTheNode: against a real namespace, an address is found on the uplink once
// it is there and missing once it is gone, and each change is reported on Changes.
func TestCheckerFollowsTheNode(t *testing.T) {
	testutil.RequirePrivileged(t, "ip")
	ns := testutil.NewNetns(t)
	ip(t, ns, `link add up0 type veth peer name peer0
link set up0 up
link set peer0 up
addr add 192.0.2.10/24 dev up0
addr add 2001:db8:1::10/64 dev up0 nodad
route add default via 192.0.2.1 dev up0
route add default via 2001:db8:1::1 dev up0
`)
	var c *Checker
	var err error
	inNetns(t, ns, func() { c, err = New(nil, nil) })
	if err != nil {
		t.Fatal(err)
	}
	defer c.Close()
	ctx, cancel := context.WithCancel(context.Background())
	watched := goInNetns(t, ns, func() { c.Watch(ctx) })
	defer func() {
		cancel()
		if err := <-watched; err != nil {
			t.Errorf("watch in %s: %v", ns, err)
		}
	}()

	cfg, err := config.Parse([]byte(`masqueradeAddress: 192.0.2.11
masqueradeCIDRs: [{cidr: "2001:db8:9::/48", address: "2001:db8:1::11"}]
`), config.Options{EnableIPv6: true})
	if err != nil {
		t.Fatal(err)
	}
	p := policy.Compile(cfg, policy.Options{EnableIPv6: true})
	check := func(want string) {
		t.Helper()
		err := c.Check(ctx, p)
		if got := fmt.Sprint(err); want == "" && err != nil || want != "" && !strings.Contains(got, want) {
			t.Fatalf("Check = %v, want %q", err, want)
		}
	}
	waitChange := func(what string) {
		t.Helper()
		select {
		case <-c.Changes():
		case <-time.After(10 * time.Second):
			t.Fatalf("%s: no change reported", what)
		}
	}
	// The watch is live once it reports a change: one made until it does (one made before its
	// subscriptions would go unseen).
	for i := 0; ; i++ {
		ip(t, ns, [2]string{"addr add 192.0.2.50/24 dev up0\n", "addr del 192.0.2.50/24 dev up0\n"}[i%2])
		select {
		case <-c.Changes():
		case <-time.After(200 * time.Millisecond):
			if i < 50 {
				continue
			}
			t.Fatal("the watch never reported a change")
		}
		break
	}
	ip(t, ns, "addr flush dev up0 to 192.0.2.50/32\n")
	check("masqueradeAddress 192.0.2.11, masqueradeCIDRs[0] 2001:db8:1::11 are not addresses of the node's uplinks (up0: 192.0.2.10, 2001:db8:1::10")
	if err := c.Check(ctx, policy.Compile(config.Default(config.Options{}), policy.Options{})); err != nil {
		t.Errorf("a policy without masquerade addresses: %v", err)
	}
	select { // a change the flush reported
	case <-c.Changes():
	case <-time.After(500 * time.Millisecond):
	}
	ip(t, ns, "addr add 192.0.2.11/24 dev up0\naddr add 2001:db8:1::11/64 dev up0 nodad\n")
	waitChange("the addresses added")
	check("")
	ip(t, ns, "addr del 2001:db8:1::11/64 dev up0\n")
	waitChange("an address removed")
	check("masqueradeCIDRs[0] 2001:db8:1::11 is not an address of the node's uplinks")
}

// TestCheckRightDevice: with a second uplink, by a policy-routing rule, an address must be one of
// the device its destinations leave by: an entry's CIDR routed out of the second device, the
// family's masqueradeAddress out of the default route's.
func TestCheckRightDevice(t *testing.T) {
	testutil.RequirePrivileged(t, "ip")
	ns := testutil.NewNetns(t)
	ip(t, ns, `link add up0 type veth peer name peer0
link set up0 up
link set peer0 up
addr add 192.0.2.10/24 dev up0
route add default via 192.0.2.1 dev up0
link add up1 type veth peer name peer1
link set up1 up
link set peer1 up
addr add 203.0.113.10/24 dev up1
route add 198.18.0.0/15 via 203.0.113.1 dev up1 table 100
rule add to 198.18.0.0/15 table 100
`)
	var c *Checker
	var err error
	inNetns(t, ns, func() { c, err = New(nil, nil) })
	if err != nil {
		t.Fatal(err)
	}
	defer c.Close()
	for _, tc := range []struct{ config, want string }{
		{`masqueradeCIDRs: [{cidr: 198.18.0.0/16, address: 203.0.113.10}]`, ""},
		{`masqueradeCIDRs: [{cidr: 198.18.0.0/16, address: 192.0.2.10}]`,
			"masqueradeCIDRs[0] 192.0.2.10 is not an address of up1, which 198.18.0.0/16 leaves by (up0: 192.0.2.10; up1: 203.0.113.10)"},
		{`masqueradeCIDRs: [{cidr: 8.8.8.0/24, address: 192.0.2.10}]`, ""},
		{`masqueradeAddress: 192.0.2.10`, ""},
		{`masqueradeAddress: 203.0.113.10`,
			"masqueradeAddress 203.0.113.10 is not an address of up0, which 0.0.0.0/0 leaves by (up0: 192.0.2.10; up1: 203.0.113.10)"},
		{"masqueradeAddress: 192.0.2.77\nmasqueradeCIDRs: [{cidr: 198.18.0.0/16, address: 192.0.2.10}]",
			"masqueradeAddress 192.0.2.77 is not an address of the node's uplinks; masqueradeCIDRs[0] 192.0.2.10 is not an address of up1, which 198.18.0.0/16 leaves by"},
	} {
		cfg, err := config.Parse([]byte(tc.config+"\n"), config.Options{})
		if err != nil {
			t.Fatal(err)
		}
		var got error
		inNetns(t, ns, func() { got = c.Check(context.Background(), policy.Compile(cfg, policy.Options{})) })
		if s := fmt.Sprint(got); tc.want == "" && got != nil || tc.want != "" && !strings.HasPrefix(s, tc.want) {
			t.Errorf("%s: Check = %v, want %q", tc.config, got, tc.want)
		}
	}
}

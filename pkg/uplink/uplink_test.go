package uplink

import (
	"context"
	"fmt"
	"log/slog"
	"net"
	"net/netip"
	"os"
	"os/exec"
	"runtime"
	"slices"
	"strings"
	"testing"
	"time"

	"golang.org/x/sys/unix"

	"github.com/ip-masq-agent/ip-masq-agent/internal/testutil"
)

// The tests build devices, addresses and routes in a network namespace of their own.

func ip(t *testing.T, ns string, batch string) {
	t.Helper()
	ipArgs(t, ns, nil, batch)
}

// ip6 runs a batch of IPv6 commands (a rule of IPv6 needs -6).
func ip6(t *testing.T, ns string, batch string) {
	t.Helper()
	ipArgs(t, ns, []string{"-6"}, batch)
}

func ipArgs(t *testing.T, ns string, opts []string, batch string) {
	t.Helper()
	if err := testutil.IPBatch(context.Background(), ns, batch, opts...); err != nil {
		t.Fatal(err)
	}
}

// inNetns runs fn on a thread of its own inside the namespace; the thread is never reused.
func inNetns(t *testing.T, ns string, fn func()) {
	t.Helper()
	f, err := os.Open("/run/netns/" + ns)
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	started := make(chan error, 1)
	go func() {
		runtime.LockOSThread() // never unlocked: the thread ends with the goroutine
		if err := unix.Setns(int(f.Fd()), unix.CLONE_NEWNET); err != nil {
			started <- err
			return
		}
		started <- nil
		fn()
	}()
	if err := <-started; err != nil {
		t.Fatalf("enter netns %s: %v", ns, err)
	}
}

func newNode(t *testing.T) string {
	t.Helper()
	testutil.RequirePrivileged(t, "ip")
	ns := testutil.NewNetns(t)
	ip(t, ns, `link add up0 type veth peer name peer0
link add lan0 type veth peer name peer1
link set up0 up
link set peer0 up
link set lan0 up
link set peer1 up
addr add 192.0.2.10/24 dev up0
addr add 192.0.2.11/24 dev up0
addr add 198.51.100.10/24 dev up0
addr add 2001:db8:1::10/64 dev up0 nodad
addr add 2001:db8:1::11/64 dev up0 nodad preferred_lft 0
addr add 2001:db8:1::12/64 dev up0 nodad
addr add 10.0.0.1/24 dev lan0
route add default via 192.0.2.1 dev up0
route add default via 2001:db8:1::1 dev up0
`)
	return ns
}

func resolve(t *testing.T, ns string, names ...string) Set {
	t.Helper()
	return resolveIn(t, ns, nil, names...)
}

// resolveIn resolves with the scope given (nil: none set).
func resolveIn(t *testing.T, ns string, scope func(netip.Prefix) bool, names ...string) Set {
	t.Helper()
	var set Set
	var err error
	done := make(chan struct{})
	inNetns(t, ns, func() {
		defer close(done)
		var r *Resolver
		if r, err = NewResolver(names); err != nil {
			return
		}
		defer r.Close()
		if scope != nil {
			r.SetScope(scope)
		}
		set, err = r.Resolve(context.Background())
	})
	<-done
	if err != nil {
		t.Fatal(err)
	}
	return set
}

func TestResolve(t *testing.T) {
	ns := newNode(t)
	set := resolve(t, ns)
	if len(set.Uplinks) != 1 || len(set.Missing) != 0 {
		t.Fatalf("uplinks %+v", set)
	}
	u := set.Uplinks[0]
	// The first address in the gateway's subnet (not the secondary .11, not the other subnet);
	// the oldest IPv6 address that is not deprecated (not ::11, not the newer ::12).
	if u.Name != "up0" || u.IPv4 != netip.MustParseAddr("192.0.2.10") || u.IPv6 != netip.MustParseAddr("2001:db8:1::10") || !u.RoutedV4 || !u.RoutedV6 || u.Via != "default route" {
		t.Fatalf("uplink %v", u)
	}
	ip(t, ns, "link set up0 address 02:00:00:00:0a:01\n")
	if got := resolve(t, ns).Uplinks[0].MAC; got != [6]byte{2, 0, 0, 0, 0xa, 1} {
		t.Fatalf("MAC %x, want the device's 02:00:00:00:0a:01", got)
	}

	// A preferred source on the default route wins.
	ip(t, ns, "route replace default via 192.0.2.1 dev up0 src 198.51.100.10\n")
	if got := resolve(t, ns).Uplinks[0].IPv4; got != netip.MustParseAddr("198.51.100.10") {
		t.Fatalf("with src on the route: %s", got)
	}

	// Named devices, whether or not they carry a default route; missing ones are reported.
	set = resolve(t, ns, "lan0", "nosuch0")
	if len(set.Uplinks) != 1 || set.Uplinks[0].Name != "lan0" || set.Uplinks[0].IPv4 != netip.MustParseAddr("10.0.0.1") ||
		set.Uplinks[0].IPv6.IsValid() || set.Uplinks[0].RoutedV4 || set.Uplinks[0].Via != "--interfaces" || fmt.Sprint(set.Missing) != "[nosuch0]" {
		t.Fatalf("named: %+v", set)
	}

	// Without default routes there is no uplink.
	ip(t, ns, "route del default dev up0\nroute del ::/0 dev up0\n")
	if set := resolve(t, ns); len(set.Uplinks) != 0 {
		t.Fatalf("without default routes: %+v", set)
	}
}

// TestAddrs: every address of an uplink that traffic can leave from (secondary and deprecated
// ones too; not link-local, nor tentative while duplicate address detection runs), which Diff
// follows.
func TestAddrs(t *testing.T) {
	ns := newNode(t)
	// Tentative while duplicate address detection runs: made to run for minutes.
	done := make(chan error, 1)
	inNetns(t, ns, func() { done <- os.WriteFile("/proc/sys/net/ipv6/conf/up0/dad_transmits", []byte("300"), 0o644) })
	if err := <-done; err != nil {
		t.Fatal(err)
	}
	ip(t, ns, "addr add 2001:db8:1::13/64 dev up0\n")
	set := resolve(t, ns)
	u := set.Uplinks[0]
	got := fmt.Sprint(sortedAddrs(set.Addrs[u.Index]))
	if want := "[192.0.2.10 192.0.2.11 198.51.100.10 2001:db8:1::10 2001:db8:1::11 2001:db8:1::12]"; got != want {
		t.Errorf("addresses %s, want %s", got, want)
	}
	ip(t, ns, "addr del 192.0.2.11/24 dev up0\n")
	diff := Diff(set, resolve(t, ns))
	if want := "uplink up0 addresses 192.0.2.10, 192.0.2.11, 198.51.100.10, 2001:db8:1::10, 2001:db8:1::11, 2001:db8:1::12 -> " +
		"192.0.2.10, 198.51.100.10, 2001:db8:1::10, 2001:db8:1::11, 2001:db8:1::12"; !slices.Contains(diff, want) {
		t.Errorf("a secondary address removed: diff %q, want %q", diff, want)
	}
}

// Routes beyond the default make uplinks: in every table a rule selects (not one no rule
// selects), toward destinations in scope, with or without a gateway, through devices with an
// address to masquerade behind and an Ethernet header.
func TestResolveRoutes(t *testing.T) {
	ns := newNode(t)
	ip(t, ns, `link add ext1 type veth peer name ext1p
link set ext1 up
link set ext1p up
addr add 203.0.113.10/24 dev ext1
addr add 2001:db8:2::10/64 dev ext1 nodad
route add 198.18.0.0/15 via 203.0.113.1 dev ext1 table 100
rule add to 198.18.0.0/15 table 100
link add ext2 type veth peer name ext2p
link set ext2 up
link set ext2p up
addr add 100.100.0.10/24 dev ext2
route add default via 100.100.0.1 dev ext2 table 200
rule add from 100.64.0.0/10 table 200
route add 100.101.0.0/16 via 100.100.0.1 dev ext2 table 300
link add pod0 type veth peer name pod0p
link set pod0 up
link set pod0p up
route add 100.64.5.5/32 dev pod0
link add br0 type bridge
link set br0 up
addr add 100.65.1.1/24 dev br0
link add br1 type bridge
link set br1 up
addr add 10.244.0.1/24 dev br1
`)
	ip6(t, ns, "route add 2001:db8:77::/64 via 2001:db8:2::1 dev ext1 table 100\nrule add to 2001:db8:77::/64 table 100\n")
	// The policy keeps 10.0.0.0/8 (lan0's 10.0.0.0/24), masquerades the rest.
	kept := netip.MustParsePrefix("10.0.0.0/8")
	scope := func(p netip.Prefix) bool {
		return !(p.Addr().Is4() && kept.Contains(p.Addr()) && p.Bits() >= kept.Bits())
	}
	names := func(set Set) string {
		var s []string
		for _, u := range set.Uplinks {
			s = append(s, u.Name+": "+u.Via)
		}
		return strings.Join(s, "; ")
	}
	if got := names(resolve(t, ns)); got != "up0: default route; ext2: default route table 200" {
		t.Errorf("without a scope, uplinks %q: only the default routes' devices", got)
	}
	set := resolveIn(t, ns, scope)
	want := "up0: default route; ext1: route 198.18.0.0/15 table 100, route 2001:db8:77::/64 table 100; ext2: default route table 200; br0: route 100.65.1.0/24"
	if got := names(set); got != want {
		t.Errorf("uplinks %q\nwant %q: not lan0 nor br1 (kept), ext2 by table 300 (no rule), pod0 (no address)", got, want)
	}
	// Where destinations leave by: the most specific routes holding them, of every table.
	for dst, want := range map[string]string{
		"198.18.0.0/16": "ext1", "2001:db8:77::1/128": "ext1", "198.0.0.0/8": "up0 ext2", "0.0.0.0/0": "up0 ext2",
		"8.8.8.0/24": "up0 ext2", "::/0": "up0", "100.65.1.7/32": "br0",
	} {
		var got []string
		for _, u := range set.LeavesBy(netip.MustParsePrefix(dst)) {
			got = append(got, u.Name)
		}
		if strings.Join(got, " ") != want {
			t.Errorf("LeavesBy(%s) = %v, want %q", dst, got, want)
		}
	}
	if u := set.Uplinks[1]; u.Name != "ext1" || u.IPv4 != netip.MustParseAddr("203.0.113.10") || u.IPv6 != netip.MustParseAddr("2001:db8:2::10") || !u.RoutedV4 || !u.RoutedV6 {
		t.Errorf("ext1: %+v", u)
	}
	// A route of the main table through a gateway toward a destination in scope counts too;
	// the default route still names up0's reason.
	ip(t, ns, "route add 100.64.0.0/10 via 10.0.0.254 dev lan0\nroute add 203.0.114.0/24 via 192.0.2.1 dev up0\n")
	if got := names(resolveIn(t, ns, scope)); !strings.Contains(got, "lan0: route 100.64.0.0/10") || !strings.HasPrefix(got, "up0: default route;") {
		t.Errorf("uplinks %q lack lan0 of its route to 100.64.0.0/10", got)
	}
	// !name leaves devices out of that set; names and exclusions do not mix.
	if got := names(resolveIn(t, ns, scope, "!ext1", "!lan0", "!ext2", "!br0")); got != "up0: default route" {
		t.Errorf("with !ext1,!lan0,!ext2,!br0: uplinks %q", got)
	}
	if got := names(resolveIn(t, ns, scope, "!up0", "!ext2", "!br0")); got != "lan0: route 100.64.0.0/10; ext1: route 198.18.0.0/15 table 100, route 2001:db8:77::/64 table 100" {
		t.Errorf("with !up0,!ext2,!br0: uplinks %q", got)
	}
	for _, bad := range [][]string{{"up0", "!ext1"}, {"!"}} {
		if err := CheckInterfaces(bad); err == nil {
			t.Errorf("--interfaces %q accepted", bad)
		}
	}
	// A device without an Ethernet header is reported, not made an uplink, whether or not its
	// route has a gateway.
	ip(t, ns, "tuntap add dev tun0 mode tun\nlink set tun0 up\naddr add 100.100.9.1/24 dev tun0\n")
	set = resolveIn(t, ns, scope)
	if len(set.Unsupported) != 1 || set.Unsupported[0].Name != "tun0" || set.Unsupported[0].Via != "route 100.100.9.0/24" || strings.Contains(names(set), "tun0") {
		t.Errorf("tun0: uplinks %q, unsupported %+v", names(set), set.Unsupported)
	}
	if d := Diff(Set{}, set); !strings.Contains(strings.Join(d, "; "), "tun0 has routes of pod traffic but no Ethernet header") {
		t.Errorf("Diff %q does not report tun0", d)
	}
	ip(t, ns, "link del tun0\n")
	if d := strings.Join(Diff(set, resolveIn(t, ns, scope)), "; "); d != "device tun0 (no Ethernet header) has no routes of pod traffic any more" {
		t.Errorf("Diff after tun0 is gone: %q", d)
	}
}

// sendTo is a Watch callback that sends the reason to changes, unless one waits there already.
func sendTo(changes chan<- string) func(string, Set) {
	return func(reason string, _ Set) {
		select {
		case changes <- reason:
		default:
		}
	}
}

// startWatch runs Watch inside the namespace until the returned stop, which fails the test when
// Watch does not return.
func startWatch(t *testing.T, ns string, log *slog.Logger) (changes <-chan string, stop func()) {
	t.Helper()
	return startWatchIn(t, ns, nil, log)
}

func startWatchIn(t *testing.T, ns string, scope func(netip.Prefix) bool, log *slog.Logger) (changes <-chan string, stop func()) {
	t.Helper()
	ctx, cancel := context.WithCancel(context.Background())
	ch := make(chan string, 1)
	stopped := make(chan struct{})
	inNetns(t, ns, func() {
		defer close(stopped)
		r, err := NewResolver(nil)
		if err != nil {
			t.Error(err)
			return
		}
		defer r.Close()
		if scope != nil {
			r.SetScope(scope)
		}
		Watch(ctx, r, sendTo(ch), log)
	})
	return ch, func() {
		t.Helper()
		cancel()
		select {
		case <-stopped:
		case <-time.After(5 * time.Second):
			t.Error("Watch did not return after the context ended")
		}
	}
}

func TestWatch(t *testing.T) {
	ns := newNode(t)
	changes, stop := startWatch(t, ns, nil)
	defer stop()
	next := func(want ...string) {
		t.Helper()
		select {
		case got := <-changes:
			for _, w := range want {
				if !strings.Contains(got, w) {
					t.Fatalf("change %q does not mention %q", got, w)
				}
			}
		case <-time.After(5 * time.Second):
			t.Fatalf("no change reported (want %q)", want)
		}
	}
	// Let Watch take its first look and subscribe.
	time.Sleep(300 * time.Millisecond)
	select {
	case got := <-changes:
		t.Fatalf("a change without one: %q", got)
	default:
	}

	// The SNAT address moves.
	ip(t, ns, "addr del 192.0.2.10/24 dev up0\naddr add 192.0.2.20/24 dev up0\n")
	next("up0 IPv4 address 192.0.2.10 -> 192.0.2.")
	// The MAC changes: frames of the node carry the new one from then on.
	ip(t, ns, "link set up0 address 02:00:00:00:0a:0b\n")
	next("up0 MAC ", "-> 02:00:00:00:0a:0b")
	// A second default route brings another uplink.
	ip(t, ns, "addr add 203.0.113.5/24 dev lan0\nroute add default via 203.0.113.1 dev lan0 metric 200\n")
	next("uplink lan0", "appeared")
	// Events that change nothing about the uplinks report nothing.
	ip(t, ns, "link add extra0 type veth peer name extra1\nlink set extra0 up\naddr add 10.9.9.9/24 dev extra0\n")
	time.Sleep(300 * time.Millisecond)
	select {
	case got := <-changes:
		t.Fatalf("a change for an unrelated device: %q", got)
	default:
	}
	// The device goes away.
	ip(t, ns, "link del lan0\n")
	next("uplink lan0 is gone")

	// Other devices churning (pods coming and going) do not hold a change back: their events
	// do not count, and those that do cannot postpone the re-read beyond maxSettle.
	churnCtx, stopChurn := context.WithCancel(context.Background())
	churned := make(chan struct{})
	go func() {
		defer close(churned)
		for i := 0; churnCtx.Err() == nil; i++ {
			batch := fmt.Sprintf("link add churn%d type veth peer name churnp%d\nlink set churn%d up\nlink del churn%d\n", i, i, i, i)
			_ = testutil.IPBatch(churnCtx, ns, batch)
		}
	}()
	defer func() { stopChurn(); <-churned }()
	time.Sleep(300 * time.Millisecond)
	start := time.Now()
	ip(t, ns, "addr del 192.0.2.20/24 dev up0\naddr add 192.0.2.30/24 dev up0\n")
	next("up0 IPv4 address 192.0.2.20 -> 192.0.2.")
	if took := time.Since(start); took > maxSettle+time.Second {
		t.Errorf("the change was reported %v after it, during churn", took)
	}
}

// A route in scope, of any table a rule selects, brings an uplink, and so does the rule that
// selects the table of a route there already; the rule or the route removed takes it away. Pod
// routes (out of scope) report nothing.
func TestWatchRoutes(t *testing.T) {
	ns := newNode(t)
	pods := netip.MustParsePrefix("10.0.0.0/8")
	changes, stop := startWatchIn(t, ns, func(p netip.Prefix) bool { return !pods.Overlaps(p) || p.Bits() < pods.Bits() }, nil)
	defer stop()
	time.Sleep(300 * time.Millisecond) // Watch's first look
	ip(t, ns, "route add 10.0.0.7/32 via 10.0.0.254 dev lan0\nroute add 198.18.0.0/15 via 10.0.0.254 dev lan0 table 100\n")
	time.Sleep(300 * time.Millisecond)
	select {
	case got := <-changes:
		t.Fatalf("a change for a route out of scope, or of a table no rule selects: %q", got)
	default:
	}
	want := func(what, phrase string) {
		t.Helper()
		select {
		case got := <-changes:
			if !strings.Contains(got, phrase) {
				t.Fatalf("%s: change %q, want %q", what, got, phrase)
			}
		case <-time.After(5 * time.Second):
			t.Fatalf("%s reported no change", what)
		}
	}
	ip(t, ns, "rule add to 198.18.0.0/15 table 100\n")
	want("the rule selecting table 100", "uplink lan0 (ifindex")
	ip(t, ns, "rule del to 198.18.0.0/15 table 100\n")
	want("the rule removed", "uplink lan0 is gone")
	ip(t, ns, "rule add to 198.18.0.0/15 table 100\n")
	want("the rule again", "appeared")
	ip(t, ns, "route del 198.18.0.0/15 table 100\n")
	want("the route removed", "uplink lan0 is gone")
}

// Stopping Watch is no error: the library reports the end of the subscriptions that Watch itself
// closed (EAGAIN on each socket), which must not reach the log as warnings on every SIGTERM.
func TestWatchStopsQuietly(t *testing.T) {
	ns := newNode(t)
	var logs testutil.Buffer
	changes, stop := startWatch(t, ns, slog.New(slog.NewTextHandler(&logs, &slog.HandlerOptions{Level: slog.LevelDebug})))
	// A change reported proves the subscriptions run (Watch subscribes before its first check);
	// the SNAT address moves back and forth until one is, since the first move may come
	// before Watch's first look.
	moves := [2]string{"addr del 192.0.2.10/24 dev up0\naddr add 192.0.2.20/24 dev up0\n", "addr del 192.0.2.20/24 dev up0\naddr add 192.0.2.10/24 dev up0\n"}
	for i := 0; ; i++ {
		ip(t, ns, moves[i%2])
		select {
		case <-changes:
		case <-time.After(time.Second):
			if i < 5 {
				continue
			}
			t.Fatal("no change reported")
		}
		break
	}
	stop()
	if strings.Contains(logs.String(), "level=WARN") {
		t.Errorf("stopping logged warnings:\n%s", logs.String())
	}
}

// TestDevice: a device's usable addresses and the destinations of its routes in the tables the
// rules select (not those of a table no rule selects), multipath routes through it among them;
// down, it is not Up; gone, it is nothing.
func TestDevice(t *testing.T) {
	ns := newNode(t)
	ip(t, ns, `link add ext1 type veth peer name ext1p
link set ext1 up
link set ext1p up
addr add 203.0.113.10/24 dev ext1
route add 198.18.0.0/15 via 203.0.113.1 dev ext1 table 100
rule add to 198.18.0.0/15 table 100
route add 100.101.0.0/16 via 203.0.113.1 dev ext1 table 300
route add 198.20.0.0/16 nexthop via 192.0.2.1 dev up0 nexthop via 203.0.113.1 dev ext1
`)
	// device reads ext1, by the ifindex it had at first.
	idx := 0
	device := func() Device {
		t.Helper()
		var d Device
		var err error
		done := make(chan struct{})
		inNetns(t, ns, func() {
			defer close(done)
			if idx == 0 {
				var ifc *net.Interface
				if ifc, err = net.InterfaceByName("ext1"); err != nil {
					return
				}
				idx = ifc.Index
			}
			var r *Resolver
			if r, err = NewResolver(nil); err != nil {
				return
			}
			defer r.Close()
			d, err = r.Device(context.Background(), idx)
		})
		<-done
		if err != nil {
			t.Fatal(err)
		}
		return d
	}
	d := device()
	if d.Name != "ext1" || !d.Up || !slices.Equal(d.Addrs, []netip.Addr{netip.MustParseAddr("203.0.113.10")}) {
		t.Fatalf("ext1: %+v", d)
	}
	for addr, want := range map[string]bool{"198.19.0.1": true, "203.0.113.7": true, "198.20.0.1": true, "100.101.0.1": false, "8.8.8.8": false} {
		if got := d.Reaches(netip.MustParseAddr(addr)); got != want {
			t.Errorf("ext1 reaches %s: %v, want %v (routes %v)", addr, got, want, d.Routes)
		}
	}
	ip(t, ns, "link set ext1 down\n")
	if d := device(); d.Name != "ext1" || d.Up {
		t.Errorf("ext1 down: %+v", d)
	}
	ip(t, ns, "link del ext1\n")
	if d := device(); d.Name != "" || d.Up || len(d.Addrs) != 0 {
		t.Errorf("ext1 gone: %+v", d)
	}
}

// compatOff turns net.ipv4.nexthop_compat_mode off in the namespace (its own sysctl): route
// dumps and events then carry a nexthop object's id alone, as a node of a route daemon that
// asks for it has them.
func compatOff(t *testing.T, ns string) {
	t.Helper()
	done := make(chan error, 1)
	inNetns(t, ns, func() { done <- os.WriteFile("/proc/sys/net/ipv4/nexthop_compat_mode", []byte("0"), 0o644) })
	if err := <-done; err != nil {
		t.Fatal(err)
	}
}

// nexthopNode is newNode with its default routes through nexthop objects (1 and 2) and compat
// mode off, and two more devices (ext1, ext2) for routes through groups of them.
func nexthopNode(t *testing.T) string {
	t.Helper()
	ns := newNode(t)
	compatOff(t, ns)
	ip(t, ns, `link set lo up
route del default dev up0
route del ::/0 dev up0
nexthop add id 1 via 192.0.2.1 dev up0
nexthop add id 2 via 2001:db8:1::1 dev up0
route add default nhid 1
route add ::/0 nhid 2
link add ext1 type veth peer name ext1p
link set ext1 up
link set ext1p up
addr add 203.0.113.10/24 dev ext1
addr add 2001:db8:2::10/64 dev ext1 nodad
link add ext2 type veth peer name ext2p
link set ext2 up
link set ext2p up
addr add 100.100.0.10/24 dev ext2
addr add 2001:db8:3::10/64 dev ext2 nodad
`)
	return ns
}

// Routes through nexthop objects make uplinks with compat mode off, where a route dump names
// the object alone: single ones (a default route per family), groups (IPv4 and IPv6, in a table
// a rule selects too), a device alone (ext2's 203.0.114.0/24, which its group route outranks
// in Via), an IPv6 gateway of an IPv4 route (BGP unnumbered); a blackhole makes none.
func TestResolveNexthops(t *testing.T) {
	ns := nexthopNode(t)
	ip(t, ns, `nexthop add id 11 via 203.0.113.1 dev ext1
nexthop add id 12 via 100.100.0.1 dev ext2
nexthop add id 10 group 11/12
route add 198.18.0.0/15 nhid 10
nexthop add id 21 via 2001:db8:2::1 dev ext1
nexthop add id 22 via 2001:db8:3::1 dev ext2
nexthop add id 20 group 21/22
route add 2001:db8:77::/64 nhid 20 table 100
nexthop add id 30 blackhole
route add 198.20.0.0/16 nhid 30
nexthop add id 40 dev ext2
route add 203.0.114.0/24 nhid 40
nexthop add id 50 via fe80::1 dev ext1
route add 100.101.0.0/16 nhid 50
`)
	ip6(t, ns, "rule add to 2001:db8:77::/64 table 100\n")
	// The dumps carry the ids alone: what the test is about.
	if out, err := exec.Command("ip", "-n", ns, "route", "show", "default").CombinedOutput(); err != nil || strings.Contains(string(out), "dev") {
		t.Fatalf("with compat mode off, the default route shows %q (%v): want its nexthop id alone", out, err)
	}
	set := resolve(t, ns)
	if len(set.Uplinks) != 1 {
		t.Fatalf("without a scope, uplinks %+v: want up0 by its default routes", set.Uplinks)
	}
	u := set.Uplinks[0]
	if u.Name != "up0" || u.IPv4 != netip.MustParseAddr("192.0.2.10") || u.IPv6 != netip.MustParseAddr("2001:db8:1::10") ||
		!u.RoutedV4 || !u.RoutedV6 || u.Via != "default route" {
		t.Fatalf("uplink %+v: want up0, 192.0.2.10 (in the gateway's subnet) and 2001:db8:1::10, by its default routes", u)
	}
	kept := netip.MustParsePrefix("10.0.0.0/8") // lan0's
	set = resolveIn(t, ns, func(p netip.Prefix) bool { return !kept.Overlaps(p) || p.Bits() < kept.Bits() })
	var got []string
	for _, u := range set.Uplinks {
		got = append(got, u.Name+": "+u.Via)
	}
	want := "up0: default route; ext1: route 100.101.0.0/16, route 2001:db8:77::/64 table 100; ext2: route 198.18.0.0/15, route 2001:db8:77::/64 table 100"
	if strings.Join(got, "; ") != want {
		t.Errorf("uplinks %q\nwant %q", strings.Join(got, "; "), want)
	}
	for dst, want := range map[string]string{"198.18.0.0/16": "ext1 ext2", "2001:db8:77::1/128": "ext1 ext2", "203.0.114.7/32": "ext2", "100.101.0.1/32": "ext1",
		"198.20.0.1/32": "up0", "8.8.8.8/32": "up0", "2001:4860::/32": "up0"} {
		var got []string
		for _, u := range set.LeavesBy(netip.MustParsePrefix(dst)) {
			got = append(got, u.Name)
		}
		if strings.Join(got, " ") != want {
			t.Errorf("LeavesBy(%s) = %v, want %q", dst, got, want)
		}
	}
}

// Watch follows nexthop objects: with compat mode off, a default route's nexthop object moved to
// another device, or removed, brings no route event, and still changes the uplinks.
func TestWatchNexthops(t *testing.T) {
	ns := nexthopNode(t)
	changes, stop := startWatch(t, ns, nil)
	defer stop()
	time.Sleep(300 * time.Millisecond) // Watch's first look
	want := func(what string, phrases ...string) {
		t.Helper()
		select {
		case got := <-changes:
			for _, p := range phrases {
				if !strings.Contains(got, p) {
					t.Fatalf("%s: change %q, want %q", what, got, p)
				}
			}
		case <-time.After(5 * time.Second):
			t.Fatalf("%s reported no change", what)
		}
	}
	ip(t, ns, "nexthop replace id 1 via 203.0.113.1 dev ext1\n")
	want("the IPv4 default route's nexthop moved to ext1", "uplink ext1 (ifindex", "appeared")
	ip(t, ns, "nexthop replace id 2 via 2001:db8:2::1 dev ext1\n")
	want("the IPv6 default route's nexthop moved to ext1", "uplink up0 is gone")
	ip(t, ns, "nexthop del id 1\nnexthop del id 2\n")
	want("the nexthops removed", "uplink ext1 is gone")
}

// Device sees the routes of a device through nexthop objects, of groups too.
func TestDeviceNexthops(t *testing.T) {
	ns := nexthopNode(t)
	ip(t, ns, "nexthop add id 11 via 203.0.113.1 dev ext1\nnexthop add id 12 via 100.100.0.1 dev ext2\nnexthop add id 10 group 11/12\nroute add 198.18.0.0/15 nhid 10\n")
	var d Device
	var err error
	done := make(chan struct{})
	inNetns(t, ns, func() {
		defer close(done)
		var ifc *net.Interface
		if ifc, err = net.InterfaceByName("ext2"); err != nil {
			return
		}
		var r *Resolver
		if r, err = NewResolver(nil); err != nil {
			return
		}
		defer r.Close()
		d, err = r.Device(context.Background(), ifc.Index)
	})
	<-done
	if err != nil {
		t.Fatal(err)
	}
	for addr, want := range map[string]bool{"198.19.0.1": true, "100.100.0.7": true, "8.8.8.8": false} {
		if got := d.Reaches(netip.MustParseAddr(addr)); got != want {
			t.Errorf("ext2 reaches %s: %v, want %v (routes %v)", addr, got, want, d.Routes)
		}
	}
}

package uplink

import (
	"context"
	"log/slog"
	"slices"
	"strings"
	"time"

	"github.com/vishvananda/netlink"
	"github.com/vishvananda/netlink/nl"
	"golang.org/x/sys/unix"
)

// Watch timing.
const (
	// settle lets a burst of netlink events (a device coming up brings links, addresses and
	// routes) end before the uplinks are read again.
	settle = 100 * time.Millisecond
	// maxSettle bounds how long events that keep coming (pods churning on a busy node) can
	// postpone the re-read.
	maxSettle = time.Second
	// resubscribeDelay paces new subscriptions after one failed.
	resubscribeDelay = time.Second
)

// Watch follows link, address, route, rule and nexthop events until ctx is done, and calls changed with a
// short reason and the new resolution each time the resolved uplinks differ from the previous
// one (the first one is made when Watch starts); changed must not block. A failed subscription
// is renewed, and since events may have been missed, the uplinks are read again then.
func Watch(ctx context.Context, r *Resolver, changed func(reason string, cur Set), log *slog.Logger) {
	if log == nil {
		log = slog.New(slog.DiscardHandler)
	}
	log = log.With("component", "uplink")
	last, err := r.Resolve(ctx)
	resolved := err == nil
	if err != nil {
		log.Warn("cannot read the uplinks", "error", err)
	}
	for ctx.Err() == nil {
		s := subscribe(log)
		if s == nil {
			select {
			case <-ctx.Done():
				return
			case <-time.After(resubscribeDelay):
				continue
			}
		}
		last, resolved = follow(ctx, r, s, last, resolved, changed, log)
		s.close()
		if ctx.Err() == nil {
			// Events were lost: look again before resubscribing.
			last, resolved = check(ctx, r, last, changed, log)
			select {
			case <-ctx.Done():
			case <-time.After(resubscribeDelay):
			}
		}
	}
}

// subscription is one set of netlink subscriptions.
type subscription struct {
	done   chan struct{}
	links  chan netlink.LinkUpdate
	addrs  chan netlink.AddrUpdate
	routes chan netlink.RouteUpdate
	// others receives one value per batch of rule and nexthop events, which the library has no
	// subscription for: which tables the rules select decides which routes count, and a
	// nexthop object's devices are those of the routes that name it (nexthop.go).
	others chan struct{}
}

func subscribe(log *slog.Logger) *subscription {
	s := &subscription{done: make(chan struct{})}
	onErr := func(err error) {
		select {
		case <-s.done:
			// close ended it: the library reports its own socket's shutdown (EAGAIN).
			log.Debug("netlink subscription closed", "error", err)
		default:
			log.Warn("netlink subscription error", "error", err)
		}
	}
	fail := func(what string, err error) *subscription {
		log.Warn("cannot subscribe to netlink "+what+" events; retrying", "error", err)
		s.close()
		return nil
	}
	// A channel is kept only once its subscription runs: the library closes it then.
	links := make(chan netlink.LinkUpdate, 64)
	if err := netlink.LinkSubscribeWithOptions(links, s.done, netlink.LinkSubscribeOptions{ErrorCallback: onErr}); err != nil {
		return fail("link", err)
	}
	s.links = links
	addrs := make(chan netlink.AddrUpdate, 64)
	if err := netlink.AddrSubscribeWithOptions(addrs, s.done, netlink.AddrSubscribeOptions{ErrorCallback: onErr}); err != nil {
		return fail("address", err)
	}
	s.addrs = addrs
	routes := make(chan netlink.RouteUpdate, 64)
	if err := netlink.RouteSubscribeWithOptions(routes, s.done, netlink.RouteSubscribeOptions{ErrorCallback: onErr}); err != nil {
		return fail("route", err)
	}
	s.routes = routes
	others, err := subscribeOthers(s.done, onErr)
	if err != nil {
		return fail("rule and nexthop", err)
	}
	s.others = others
	return s
}

// subscribeOthers subscribes to the IPv4 and IPv6 rule events and the nexthop events, in the
// namespace of the calling thread, until done is closed; the channel is closed when the
// subscription ends. A kernel without nexthop objects (before 5.3) has no such group, and
// ignores it.
func subscribeOthers(done <-chan struct{}, onErr func(error)) (chan struct{}, error) {
	sock, err := nl.Subscribe(unix.NETLINK_ROUTE, unix.RTNLGRP_IPV4_RULE, unix.RTNLGRP_IPV6_RULE, unix.RTNLGRP_NEXTHOP)
	if err != nil {
		return nil, err
	}
	ch := make(chan struct{}, 1)
	go func() {
		<-done
		sock.Close()
	}()
	go func() {
		defer close(ch)
		for {
			msgs, from, err := sock.Receive()
			if err != nil {
				onErr(err)
				return
			}
			if from.Pid != nl.PidKernel || len(msgs) == 0 {
				continue
			}
			select {
			case ch <- struct{}{}:
			case <-done:
				return
			default: // one waits already
			}
		}
	}()
	return ch, nil
}

// close ends the subscriptions and drains their channels until the library closes them, so that
// none of its goroutines stays blocked on a send.
func (s *subscription) close() {
	select {
	case <-s.done:
	default:
		close(s.done)
	}
	for s.links != nil || s.addrs != nil || s.routes != nil || s.others != nil {
		select {
		case _, ok := <-s.links:
			if !ok {
				s.links = nil
			}
		case _, ok := <-s.addrs:
			if !ok {
				s.addrs = nil
			}
		case _, ok := <-s.routes:
			if !ok {
				s.routes = nil
			}
		case _, ok := <-s.others:
			if !ok {
				s.others = nil
			}
		}
	}
}

// follow reads events until ctx is done or a subscription ends, and returns the last resolution.
// Only events that can change the uplinks count: a device, or an address of a device, that is
// an uplink (or would be one with an address), is named by --interfaces or has no Ethernet
// header and routes of pod traffic; routes that can make one (Resolver.relevant); rules and
// nexthop objects. A node's pods bring a stream of others (their veths and routes). While the
// last resolution failed, every event counts.
func follow(ctx context.Context, r *Resolver, s *subscription, last Set, resolved bool, changed func(string, Set), log *slog.Logger) (Set, bool) {
	timer := time.NewTimer(time.Hour)
	timer.Stop()
	defer timer.Stop()
	var first time.Time // of the events the armed timer waits on; zero when it is not armed
	arm := func() {
		now := time.Now()
		if first.IsZero() {
			first = now
		}
		timer.Reset(min(settle, maxSettle-now.Sub(first)))
	}
	// The state may have changed between the resolution before and the subscription.
	arm()
	for {
		select {
		case <-ctx.Done():
			return last, resolved
		case u, ok := <-s.links:
			if !ok {
				return last, resolved
			}
			if !resolved || last.has(u.Attrs().Index) || slices.Contains(r.names, u.Attrs().Name) {
				arm()
			}
		case u, ok := <-s.addrs:
			if !ok {
				return last, resolved
			}
			if !resolved || last.has(u.LinkIndex) {
				arm()
			}
		case u, ok := <-s.routes:
			if !ok {
				return last, resolved
			}
			if !resolved || r.relevant(u.Route) {
				arm()
			}
		case _, ok := <-s.others:
			if !ok {
				return last, resolved
			}
			arm()
		case <-timer.C:
			first = time.Time{}
			last, resolved = check(ctx, r, last, changed, log)
		}
	}
}

// has reports whether the device with ifindex is one of the set's uplinks, of its devices
// without Ethernet header, or of those waiting for an address.
func (s Set) has(ifindex int) bool {
	is := func(u Uplink) bool { return u.Index == ifindex }
	return slices.ContainsFunc(s.Uplinks, is) || slices.ContainsFunc(s.Unsupported, is) || slices.Contains(s.waiting, ifindex)
}

// check resolves the uplinks and reports a difference from last; false when it could not
// resolve them (last is kept then).
func check(ctx context.Context, r *Resolver, last Set, changed func(string, Set), log *slog.Logger) (Set, bool) {
	cur, err := r.Resolve(ctx)
	if err != nil {
		if ctx.Err() == nil {
			log.Warn("cannot read the uplinks", "error", err)
		}
		return last, false
	}
	diff := Diff(last, cur)
	if len(diff) == 0 {
		return cur, true
	}
	reason := strings.Join(diff, "; ")
	log.Debug("uplinks changed", "change", reason)
	changed(reason, cur)
	return cur, true
}

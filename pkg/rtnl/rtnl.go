// Package rtnl opens the route netlink sockets the agent asks the kernel through, in the calling
// thread's network namespace. The netlink library takes no context, so each socket carries
// Timeout instead: a request the kernel does not answer fails rather than hanging the agent.
package rtnl

import (
	"errors"
	"fmt"
	"time"

	"github.com/vishvananda/netlink"
	"github.com/vishvananda/netlink/nl"
	"github.com/vishvananda/netns"
	"golang.org/x/sys/unix"
)

// Timeout bounds every send and receive on the sockets this package opens.
const Timeout = 5 * time.Second

// Handle is a route netlink handle for the library's requests (links, addresses, routes,
// qdiscs, filters).
func Handle() (*netlink.Handle, error) {
	h, err := netlink.NewHandle(unix.NETLINK_ROUTE)
	if err != nil {
		return nil, fmt.Errorf("netlink: %w", err)
	}
	if err := h.SetSocketTimeout(Timeout); err != nil {
		h.Close()
		return nil, fmt.Errorf("netlink: %w", err)
	}
	return h, nil
}

// Socket is a bare route netlink socket, for the requests a caller builds itself (nexthop
// objects, which the library's handle does not read).
func Socket() (*nl.SocketHandle, error) {
	s, err := nl.GetNetlinkSocketAt(netns.None(), netns.None(), unix.NETLINK_ROUTE)
	if err != nil {
		return nil, fmt.Errorf("netlink: %w", err)
	}
	tv := unix.NsecToTimeval(Timeout.Nanoseconds())
	if err := errors.Join(s.SetSendTimeout(&tv), s.SetReceiveTimeout(&tv)); err != nil {
		s.Close()
		return nil, fmt.Errorf("netlink: %w", err)
	}
	return &nl.SocketHandle{Socket: s}, nil
}

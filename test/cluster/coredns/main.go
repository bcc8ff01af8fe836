// Command coredns is CoreDNS with only the plugins the test cluster's DNS uses, built from the
// Go module proxy by `make coredns` in this module of its own (coredns's dependencies would
// otherwise move the Kubernetes tools module's). The stock build imports every plugin
// (core/plugin): cloud DNS providers, etcd and more that the cluster never runs.
package main

import (
	"github.com/coredns/coredns/core/dnsserver"
	"github.com/coredns/coredns/coremain"

	_ "github.com/coredns/coredns/plugin/cache"
	_ "github.com/coredns/coredns/plugin/errors"
	_ "github.com/coredns/coredns/plugin/forward"
	_ "github.com/coredns/coredns/plugin/health"
	_ "github.com/coredns/coredns/plugin/hosts"
	_ "github.com/coredns/coredns/plugin/kubernetes"
	_ "github.com/coredns/coredns/plugin/loadbalance"
	_ "github.com/coredns/coredns/plugin/log"
	_ "github.com/coredns/coredns/plugin/loop"
	_ "github.com/coredns/coredns/plugin/ready"
	_ "github.com/coredns/coredns/plugin/reload"
	_ "github.com/coredns/coredns/plugin/template"
)

// The plugins in the order a query passes them: upstream's plugin.cfg order, narrowed.
func init() {
	dnsserver.Directives = []string{"reload", "ready", "health", "errors", "log", "loadbalance",
		"cache", "template", "hosts", "kubernetes", "loop", "forward"}
}

func main() { coremain.Run() }

// Package e2enet is Kubernetes' end-to-end test binary narrowed to sig-network: the tests of
// k8s.io/kubernetes/test/e2e/network and test/e2e/common/network, with the framework's flags
// and suite setup, and nothing of the cloud providers or the other SIGs that package
// k8s.io/kubernetes/test/e2e pulls in. `make k8s-e2e` compiles it into
// bin/k8s/VERSION/e2e-network.test; it takes the flags of upstream's e2e.test (--kubeconfig,
// --kubectl-path, --list-tests, --list-images, -ginkgo.focus, ...). The packages those tests
// import register tests of other SIGs too; a run without -ginkgo.focus runs [sig-network]'s
// alone (--list-tests still lists them all).
package e2enet

import (
	"context"
	"flag"
	"fmt"
	"os"
	"testing"
	"time"

	"github.com/onsi/ginkgo/v2"
	"github.com/onsi/gomega"

	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/client-go/kubernetes"
	"k8s.io/component-base/logs"
	"k8s.io/component-base/version"
	"k8s.io/klog/v2"
	"k8s.io/kubernetes/test/e2e/framework"
	"k8s.io/kubernetes/test/e2e/framework/config"
	e2enode "k8s.io/kubernetes/test/e2e/framework/node"
	e2epod "k8s.io/kubernetes/test/e2e/framework/pod"
	utilnet "k8s.io/utils/net"

	// The logging flags (-v, --vmodule) on the command line.
	_ "k8s.io/component-base/logs/testinit"

	// What the framework does around every test: dumps on failure, metrics, and the check that
	// every node is still ready afterwards.
	_ "k8s.io/kubernetes/test/e2e/framework/debug/init"
	_ "k8s.io/kubernetes/test/e2e/framework/metrics/init"
	_ "k8s.io/kubernetes/test/e2e/framework/node/init"

	// The tests: [sig-network] and "Networking Granular Checks: Pods".
	_ "k8s.io/kubernetes/test/e2e/common/network"
	_ "k8s.io/kubernetes/test/e2e/network"
)

func TestMain(m *testing.M) {
	showVersion := flag.Bool("version", false, "print the Kubernetes version of the tests and exit")
	config.CopyFlags(config.Flags, flag.CommandLine)
	framework.RegisterCommonFlags(flag.CommandLine)
	framework.RegisterClusterFlags(flag.CommandLine)
	flag.Parse()
	if *showVersion {
		fmt.Println(version.Get())
		os.Exit(0)
	}
	if flag.NArg() > 0 {
		fmt.Fprintf(os.Stderr, "unexpected arguments: %q\n", flag.Args())
		os.Exit(2)
	}
	// Handles --list-tests and --list-images (and exits), and fills in the defaults.
	framework.AfterReadingAllFlags(&framework.TestContext)
	os.Exit(m.Run())
}

func TestE2E(t *testing.T) {
	// InitLogs turns contextual logging off; the framework's logging wants it on.
	logs.InitLogs()
	defer logs.FlushLogs()
	klog.EnableContextualLogging(true)

	gomega.RegisterFailHandler(framework.Fail)
	suite, reporter := framework.CreateGinkgoConfig()
	if len(suite.FocusStrings) == 0 {
		// test/e2e/network imports apps, scheduling and common/{node,storage}, whose tests
		// register too (765 in all): without a focus, run the sig-network ones alone.
		suite.FocusStrings = []string{sigNetwork}
	}
	ginkgo.RunSpecs(t, "Kubernetes sig-network e2e suite", suite, reporter)
}

// The cluster checks run once, on the first ginkgo process; every process then learns the
// cluster's IP family.
var _ = ginkgo.SynchronizedBeforeSuite(func(ctx context.Context) []byte {
	setupSuite(ctx)
	return nil
}, func(ctx context.Context, _ []byte) {
	c, err := framework.LoadClientset()
	framework.ExpectNoError(err, "load the client")
	framework.TestContext.IPFamily = clusterIPFamily(ctx, c)
	framework.Logf("cluster IP family: %s", framework.TestContext.IPFamily)
})

// setupSuite waits, as upstream's suite does, until the cluster is fit for tests: every node
// schedulable, the number of nodes known (the tests that need two skip below it), and every
// kube-system pod ready.
func setupSuite(ctx context.Context) {
	c, err := framework.LoadClientset()
	framework.ExpectNoError(err, "load the client")
	tc := &framework.TestContext
	if tc.CleanStart {
		keep := []string{metav1.NamespaceSystem, metav1.NamespaceDefault, metav1.NamespacePublic, "kube-node-lease"}
		deleted, err := framework.DeleteNamespaces(ctx, c, nil, keep)
		framework.ExpectNoError(err, "delete the namespaces of earlier runs")
		framework.ExpectNoError(framework.WaitForNamespacesDeleted(ctx, c, deleted, namespaceCleanup), "wait for %v to go", deleted)
	}
	timeouts := framework.NewTimeoutContext()
	framework.ExpectNoError(e2enode.WaitForAllNodesSchedulable(ctx, c, timeouts.NodeSchedulable))
	if tc.CloudConfig.NumNodes == framework.DefaultNumNodes {
		nodes, err := e2enode.GetReadySchedulableNodes(ctx, c)
		framework.ExpectNoError(err)
		tc.CloudConfig.NumNodes = len(nodes.Items)
	}
	framework.ExpectNoError(e2epod.WaitForAlmostAllPodsReady(ctx, c, metav1.NamespaceSystem, tc.MinStartupPods, tc.AllowedNotReadyNodes, timeouts.SystemPodsStartup),
		"wait for the kube-system pods")
	framework.Logf("e2e test version: %s, %d schedulable nodes", version.Get().GitVersion, tc.CloudConfig.NumNodes)
	if v, err := c.Discovery().ServerVersion(); err == nil {
		framework.Logf("kube-apiserver version: %s", v.GitVersion)
	}
}

// sigNetwork is the focus of a run given none.
const sigNetwork = `\[sig-network\]`

// namespaceCleanup bounds --clean-start's wait for the namespaces it deletes.
const namespaceCleanup = 15 * time.Minute

// clusterIPFamily is the family of the kubernetes Service's cluster IP, "ipv4" or "ipv6".
func clusterIPFamily(ctx context.Context, c kubernetes.Interface) string {
	svc, err := c.CoreV1().Services(metav1.NamespaceDefault).Get(ctx, "kubernetes", metav1.GetOptions{})
	framework.ExpectNoError(err, "get the kubernetes Service")
	if utilnet.IsIPv6String(svc.Spec.ClusterIP) {
		return "ipv6"
	}
	return "ipv4"
}

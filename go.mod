module github.com/ip-masq-agent/ip-masq-agent

go 1.26.8

require (
	github.com/fsnotify/fsnotify v1.10.1
	sigs.k8s.io/yaml v1.6.0
)

require (
	github.com/cilium/ebpf v0.22.0 // indirect
	go.yaml.in/yaml/v2 v2.4.4 // indirect
	golang.org/x/sys v0.50.0 // indirect
	k8s.io/api v0.37.2 // indirect
	k8s.io/apimachinery v0.37.2 // indirect
)

tool github.com/cilium/ebpf/cmd/bpf2go

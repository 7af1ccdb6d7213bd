//! Taking a node over from kube-proxy: finding its rules and removing them once lbproxy serves
//! every Service.

pub mod kube_proxy;
